"""Surface similarity of the two outputs, on token ids (rapidfuzz does the dynamic programming in C)."""

from __future__ import annotations

from rapidfuzz.distance import LCSseq, Levenshtein

from regress.metrics.base import Output, Pair, Values, metric


@metric(
    "surface",
    outputs=[
        Output("edit_distance", "token-level Levenshtein distance / length of the longer output (0 = same, 1 = nothing shared)",
               label="edit dist.", better="lower", headline=70, column=True),
        Output("rouge_l", "ROUGE-L F1 over tokens (longest common subsequence), 1 = same", label="ROUGE-L",
               better="higher"),
    ],
)
def surface() -> "callable":
    def score(pair: Pair) -> Values:
        g = pair.golden.output_token_ids.tolist()
        c = pair.candidate.output_token_ids.tolist()
        if g == c:
            return {"edit_distance": 0.0, "rouge_l": 1.0}
        lcs = LCSseq.similarity(g, c)
        rouge = 0.0 if lcs == 0 else 2 * lcs / (len(g) + len(c))
        return {"edit_distance": float(Levenshtein.normalized_distance(g, c)), "rouge_l": float(rouge)}

    return score
