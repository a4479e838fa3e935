"""``python -m ema_ckpt``."""

from .cli import main

main()
