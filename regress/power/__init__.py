"""Detection power: how small a change the gate fails (``regress power``).

The ladder (:mod:`regress.power.ladder`) plants weight noise of growing strength in the
baseline's own model, checks each step against the golden like any candidate, and scores each
noise arm against the other arms' envelope; the record (:mod:`regress.power.record`) says which
is the smallest step the gate fails and how far below it the noise stays.
"""
