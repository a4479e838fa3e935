"""What every reader of an untrusted pickle shares: the one loader (:mod:`.load`:
:func:`~.load.load_pickle` over a format's :class:`~.load.Allowlist`), the bounds walk before
CPython's C unpickler (:mod:`.bounds`), the rules (:mod:`.rules`: how a refused global is
reported, ``torch.Size``'s and the dtypes' stand-ins, what torch's weights-only unpickler
refused), and for pickles of millions of objects an unpickler whose memo keeps only what the
pickle fetches again (:mod:`.memo`).

Each format's allowlist, a table of the globals it admits and their stand-ins, lives with the
format: DCP ``.metadata`` in :mod:`ema_ckpt.formats.dcp.metadata_unpickle`, a ``torch.save``
record's ``data.pkl`` in :mod:`ema_ckpt.torch_records.pickles` and a whole file's pickle in
:mod:`ema_ckpt.torch_records.tree`, DeepSpeed files in :mod:`ema_ckpt.formats.deepspeed.fastload`.
"""
