"""Answer metrics for QA: exact match and token F1 with the standard SQuAD / HotpotQA normalisation.

Normalisation (SQuAD v1.1 evaluation script, also used by HotpotQA, 2WikiMultihopQA and MuSiQue):
lower-case, drop punctuation, drop the articles "a", "an", "the", collapse whitespace. F1 follows
HotpotQA: if either side normalises to "yes", "no" or "noanswer" and they differ, F1 is 0 (token
overlap between "yes" and "no" answers would otherwise reward a wrong polarity). With several gold
answers (aliases) the best score over them counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _exact_match_one(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _f1_one(prediction: str, gold: str) -> float:
    pred_norm, gold_norm = normalize_answer(prediction), normalize_answer(gold)
    if (pred_norm in _SPECIAL or gold_norm in _SPECIAL) and pred_norm != gold_norm:
        return 0.0
    pred_tokens, gold_tokens = pred_norm.split(), gold_norm.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _golds(answers: str | Iterable[str]) -> list[str]:
    golds = [answers] if isinstance(answers, str) else list(answers)
    if not golds:
        raise ValueError("at least one gold answer is needed to score a prediction")
    return golds


def exact_match(prediction: str, answers: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    return max(_exact_match_one(prediction, g) for g in _golds(answers))


def f1_score(prediction: str, answers: str | Iterable[str]) -> float:
    """Token-level F1 against the best-matching gold answer, in [0, 1]."""
    return max(_f1_one(prediction, g) for g in _golds(answers))
