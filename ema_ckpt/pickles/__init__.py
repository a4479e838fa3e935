"""What every reader and writer of a pickle shares: the one loader (:mod:`.load`, over a
format's allowlist), the bounds walk before CPython's C unpickler (:mod:`.bounds`), the rules
(:mod:`.rules`: a refused global's report, ``torch.Size``'s and the dtypes' stand-ins, what
torch's weights-only unpickler refused), the lean memo for pickles of millions of objects
(:mod:`.memo`), and the one writer of opcodes (:mod:`.emit`). Each format's allowlist, a
table of the globals it admits and their stand-ins, lives with the format.
"""
