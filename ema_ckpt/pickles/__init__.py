"""Pickles read without running them: the bounds walk before CPython's C unpickler
(:mod:`.bounds`), the restricted DCP ``.metadata`` unpickler (:mod:`.dcp_metadata`), and the
rules every weights-only load shares (:mod:`.rules`). ``torch.save`` records' ``data.pkl`` is
read by :mod:`ema_ckpt.torch_records.pickles` through the same bounds walk.
"""
