"""What every reader of an untrusted pickle shares: the bounds walk before CPython's C
unpickler (:mod:`.bounds`) and the rules (:mod:`.rules`: how a refused global is reported,
``torch.Size``'s stand-in, what torch's weights-only unpickler refused), and for pickles of
millions of objects an unpickler whose memo keeps only what the pickle fetches again
(:mod:`.memo`).

Each restricted unpickler lives with the format it reads and builds on these: DCP
``.metadata`` in :mod:`ema_ckpt.formats.dcp.metadata_unpickle`, a ``torch.save`` record's
``data.pkl`` in :mod:`ema_ckpt.torch_records.pickles` and a whole file's pickle in
:mod:`ema_ckpt.torch_records.tree`, DeepSpeed files in :mod:`ema_ckpt.formats.deepspeed.unpickle`.
"""
