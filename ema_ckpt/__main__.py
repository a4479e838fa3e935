"""``python -m ema_ckpt``: the same entry point as the ``ema-ckpt`` script."""

from ._entry import main

main()
