"""The pass@k estimator of Chen et al. 2021 (1 - C(n-c,k)/C(n,k)) against values computed by hand."""

import math

import pytest

from app.evaluation.config import EvalConfig
from app.evaluation.metrics import pass_at_k, reported_ks, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        # k = 1 is the fraction correct.
        (10, 3, 1, 3 / 10),
        # n=5, c=2, k=2: the 2 draws miss both correct ones in C(3,2)=3 of C(5,2)=10 ways.
        (5, 2, 2, 1 - 3 / 10),
        # n=4, c=1, k=2: C(3,2)=3 misses of C(4,2)=6.
        (4, 1, 2, 1 - 3 / 6),
        # n=8, c=1, k=4: C(7,4)=35 of C(8,4)=70 draws miss the correct one.
        (8, 1, 4, 1 - 35 / 70),
        # n=10, c=2, k=5: C(8,5)=56 of C(10,5)=252.
        (10, 2, 5, 1 - 56 / 252),
        # n = k: pass@k is whether any sample is correct.
        (4, 1, 4, 1.0),
        (4, 0, 4, 0.0),
        # Fewer incorrect samples than k: every draw holds a correct one.
        (6, 4, 3, 1.0),
        (6, 0, 3, 0.0),
        (6, 6, 1, 1.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_with_large_n_stays_exact_and_in_range():
    # n=200, c=1, k=100: exactly half of the C(200,100) draws contain the one correct sample.
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5, abs=1e-12)
    assert 0.0 <= pass_at_k(1000, 3, 17) <= 1.0
    # C(n-c,k)/C(n,k) = prod_{i<c} (n-k-i)/(n-i): with c=3, 1 - (983*982*981)/(1000*999*998).
    assert pass_at_k(1000, 3, 17) == pytest.approx(1 - (983 * 982 * 981) / (1000 * 999 * 998), rel=1e-12)
    # A small pass@k keeps its digits: 1 correct of 100000 at k=1 is 1e-5 to the last bit, not 1 - 0.99999.
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5, rel=1e-15, abs=0)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_summary_averages_prompts_with_a_clustered_standard_error():
    # Four prompts, n=4 samples each, k=2: per prompt 1 - C(4-c,2)/C(4,2) with C(4,2)=6.
    # c=0 -> 0; c=1 -> 1 - 3/6 = 1/2; c=2 -> 1 - 1/6 = 5/6; c=4 -> 1.
    result = summarize([0, 1, 2, 4], n=4, k=2)
    per_prompt = [0.0, 1 / 2, 5 / 6, 1.0]
    assert result.per_prompt == pytest.approx(per_prompt)
    mean = 7 / 12  # (0 + 1/2 + 5/6 + 1) / 4
    assert result.value == pytest.approx(mean)
    # Clustered SE: sample standard deviation of the per-prompt values over sqrt(4).
    variance = sum((x - mean) ** 2 for x in per_prompt) / 3
    assert result.stderr == pytest.approx(math.sqrt(variance / 4))
    # The same numbers written out: deviations -7/12, -1/12, 3/12, 5/12 -> squares sum 84/144.
    assert result.stderr == pytest.approx(math.sqrt(84 / 144 / 3 / 4))


def test_one_prompt_has_no_standard_error():
    assert math.isnan(summarize([1], n=2, k=1).stderr)


def test_reported_ks_are_one_the_powers_of_two_below_k_and_k():
    assert reported_ks(1) == [1]
    assert reported_ks(8) == [1, 2, 4, 8]
    assert reported_ks(10) == [1, 2, 4, 8, 10]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"k": 0}, "eval.k=0"),
        ({"k": 4, "samples_per_prompt": 2}, "eval.samples_per_prompt=2 is below eval.k=4"),
        ({"num_prompts": 0}, "eval.num_prompts"),
        ({"temperature": 0.0, "k": 4, "samples_per_prompt": 4}, "eval.temperature=0 is greedy"),
        ({"temperature": 3.0}, "eval.temperature"),
        ({"top_p": 0.0}, "eval.top_p"),
        ({"max_new_tokens": 0}, "eval.max_new_tokens"),
        ({"seed": 2**70}, "eval.seed"),
    ],
)
def test_bad_settings_name_the_key(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EvalConfig(**kwargs)


def test_empty_sampling_values_come_from_the_rollout_section():
    settings = EvalConfig(temperature=0.5).resolved(temperature=1.0, top_p=0.9, max_new_tokens=7, seed=3)
    assert (settings.temperature, settings.top_p, settings.max_new_tokens, settings.seed) == (0.5, 0.9, 7, 3)


def test_answer_rate_counts_completions_with_an_extracted_answer_apart_from_correctness():
    """Format compliance: a boxed answer present, right or wrong; a verifier reporting no extraction is None."""
    from app.evaluation.run import EvalResult, Sample
    from app.rollout.base import Completion
    from rewards.registry import build_verifier
    from rewards.types import Score, VerifierInput

    math_verifier = build_verifier("math", extraction=["boxed"], timeout_s=5.0)

    def sample(prompt: int, text: str) -> Sample:
        s = math_verifier(VerifierInput("q", text, "42", {"task": "math"}))
        breakdown = {"math": {**s.breakdown, "reward": s.reward, "correct": s.correct}}  # as the runner nests it
        return Sample(prompt, Completion([1], [2], [0.0], "stop", 0), text, Score(s.reward, s.correct, breakdown))

    samples = [
        sample(0, "so \\boxed{42}"),  # answered, correct
        sample(0, "so \\boxed{41}"),  # answered, wrong
        sample(1, "the answer is 42"),  # no box: not answered (and not correct under extraction [boxed])
        sample(1, "\\boxed{42.0}"),
    ]
    assert [s.answered for s in samples] == [True, True, False, True]
    assert [s.correct for s in samples] == [True, False, False, True]
    result = EvalResult.from_samples(samples, num_prompts=2, n=2)
    assert result.per_prompt == [0.5, 0.5] and result.correct == [1, 1] and result.answer_rate == 0.75
    plain = Sample(0, Completion([1], [2], [0.0], "stop", 0), "x", Score(1.0, True, {"exact": {"reward": 1.0}}))
    assert plain.answered is None
    assert EvalResult.from_samples([plain], num_prompts=1, n=1).answer_rate is None
