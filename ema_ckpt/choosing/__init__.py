"""Choosing an average by the user's own evaluation (``select``): the candidates planned
(:mod:`.candidates`), the evaluation command run and its score read (:mod:`.evaluation`), the
score cache (:mod:`.scores`), the greedy soup (:mod:`.soup`), the plot (:mod:`.plot`).
"""
