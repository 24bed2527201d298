"""Penalties, logit_bias and min_tokens: hand-computed maths, the batched device state against the per-token
reference on fresh random inputs, in-place counting, row bookkeeping, and a host cost that does not grow with
what is enabled.

Tolerance: exact (torch.equal). Both sides do the same fp32 operations per element in the same order (add the
bias, divide or multiply by r, subtract f*c, subtract p); elements a rule leaves alone are x + 0 / x - 0 in the
batched form, which is x exactly.
"""

from __future__ import annotations

import collections

import pytest
import torch

from m3serve.engine.penalties import PenaltyState, reference_process
from m3serve.engine.request import Request, Status
from m3serve.engine.sampling_params import SamplingParams
from m3serve.opcount import AtenOpCount

INF = float("inf")
EOS = {1}


def _req(rid: int, prompt, output, params: SamplingParams, status=Status.RUNNING) -> Request:
    r = Request(rid, list(prompt), params)
    r.output_token_ids = list(output)
    r.status = status
    return r


LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])
PROMPT, OUTPUT = [0, 4], [3, 3, 2]
HAND = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                      logit_bias={1: 1.0, 5: -0.5}, stop_token_ids=[4])


@pytest.mark.parametrize("min_tokens,expected", [
    # x = logits + bias = [2, 0, .5, 3, -2, -.5]; 3 tokens out < 5: EOS 1 and stop id 4 -> -inf;
    # seen {0, 2, 3, 4}: r = 2 -> [1, -inf, .25, 1.5, -inf, -.5]; counts {3: 2, 2: 1}: -0.5 c - 0.25
    (5, [1.0, -INF, -0.5, 0.25, -INF, -0.5]),
    # 3 tokens out = min_tokens: nothing forbidden; the negative seen logit -2 is multiplied: -4
    (3, [1.0, 0.0, -0.5, 0.25, -4.0, -0.5]),
])
def test_hand_computed(min_tokens, expected):
    params = SamplingParams(**{**HAND.__dict__, "min_tokens": min_tokens})
    want = torch.tensor(expected)
    assert torch.equal(reference_process(LOGITS, PROMPT, OUTPUT, params, EOS), want)
    state = PenaltyState(4, 6, "cpu", EOS)
    req = _req(0, PROMPT, OUTPUT, params)
    rows = state.rows_for([req])
    raw = LOGITS.clone()[None]
    assert torch.equal(state.apply(raw, rows)[0], want)
    assert torch.equal(raw[0], LOGITS)                      # the raw logits (logprobs) are left alone


def test_ignore_eos_keeps_eos_allowed_under_min_tokens():
    params = SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[4])
    out = reference_process(LOGITS, [], [], params, EOS)
    assert out[1] == LOGITS[1] and out[4] == -INF


def _random_params(g: torch.Generator, vocab: int) -> SamplingParams:
    def u(lo, hi):
        return float(torch.empty(1).uniform_(lo, hi, generator=g))
    bias = {int(t): u(-5, 5) for t in torch.randint(0, vocab, (3,), generator=g)}
    return SamplingParams(repetition_penalty=u(0.5, 2.0), frequency_penalty=u(-2, 2), presence_penalty=u(-2, 2),
                          logit_bias=bias, min_tokens=int(torch.randint(0, 6, (1,), generator=g)),
                          stop_token_ids=[int(torch.randint(0, vocab, (1,), generator=g))], max_tokens=None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_state_equals_reference_over_steps(seed):
    """Random requests (some without processing, pointing at the neutral row) over several steps: every step's
    processed logits equal the reference, and the in-place counts follow the sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab, steps = 50, 6
    reqs = []
    for i in range(6):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        params = _random_params(g, vocab) if i % 3 else SamplingParams(max_tokens=None)
        reqs.append(_req(i, prompt, output, params))
    state = PenaltyState(8, vocab, "cpu", EOS)
    for _ in range(steps):
        logits = torch.randn(len(reqs), vocab, generator=g) * 4
        raw = logits.clone()
        rows = state.rows_for(reqs)
        got = state.apply(logits, rows)
        assert torch.equal(logits, raw)
        for i, r in enumerate(reqs):
            want = reference_process(raw[i], r.prompt_token_ids, r.output_token_ids, r.params, EOS)
            assert torch.equal(got[i], want), (i, (got[i] - want).abs().max())
        tokens = torch.randint(0, vocab, (len(reqs),), generator=g)
        state.record(rows, tokens)
        for r, t in zip(reqs, tokens.tolist()):
            r.output_token_ids.append(t)
    for r, row in zip(reqs, state.rows_for(reqs).tolist()):
        if row == state.neutral:
            continue
        want = torch.zeros(vocab)
        for t, c in collections.Counter(r.output_token_ids).items():
            want[t] = c
        assert torch.equal(state.counts[row], want)
        assert state.seen[row].nonzero().flatten().tolist() == sorted(set(r.prompt_token_ids) | set(r.output_token_ids))
        assert state.remaining[row].item() == r.params.min_tokens - len(r.output_token_ids)


def test_neutral_rows_are_untouched_bit_for_bit():
    state = PenaltyState(2, 30, "cpu", EOS)
    plain = _req(0, [1, 2, 3], [4], SamplingParams())
    pen = _req(1, [1, 2, 3], [4], SamplingParams(repetition_penalty=1.3, logit_bias={5: 2.0}))
    logits = torch.randn(2, 30)
    out = state.apply(logits, state.rows_for([plain, pen]))
    assert torch.equal(out[0], logits[0]) and not torch.equal(out[1], logits[1])


def test_no_processing_no_state():
    state = PenaltyState(2, 30, "cpu", EOS)
    assert state.rows_for([_req(0, [1], [], SamplingParams(temperature=0.0))]) is None
    assert state.counts is None                               # nothing allocated for a plain batch


def test_rows_tensor_reused_while_the_batch_is_unchanged():
    state = PenaltyState(4, 30, "cpu", EOS)
    a = _req(0, [1], [], SamplingParams(presence_penalty=1.0))
    b = _req(1, [2], [], SamplingParams())
    first = state.rows_for([a, b])
    assert state.rows_for([a, b]) is first                   # steady decode: no new upload
    state.release(a)
    assert state.rows_for([a, b]) is not first


def test_rows_go_to_running_requests_and_are_rebuilt_after_eviction():
    state = PenaltyState(2, 30, "cpu", EOS)
    p = SamplingParams(frequency_penalty=1.0)
    a, b, c = (_req(i, [1, 2], [3, 3], p) for i in range(3))
    state.rows_for([a, b])
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        state.rows_for([c])                                   # both rows belong to running requests
    a.status = Status.WAITING                                 # preempted: its row may be taken
    (row_c,) = state.rows_for([c]).tolist()
    assert state.counts[row_c, 3] == 2 and state.remaining[row_c].item() == -2
    c.status = Status.FINISHED
    a.status = Status.RUNNING
    a.output_token_ids.append(7)
    (row_a,) = state.rows_for([a]).tolist()                   # rebuilt from its tokens
    assert state.counts[row_a, 3] == 2 and state.counts[row_a, 7] == 1 and state.remaining[row_a].item() == -3


def test_bad_shapes_name_the_tensors():
    state = PenaltyState(2, 30, "cpu", EOS)
    rows = state.rows_for([_req(0, [1], [], SamplingParams(presence_penalty=1.0))])
    with pytest.raises(ValueError, match=r"logits/rows: expected \[R, 30\]"):
        state.apply(torch.zeros(1, 31), rows)


def _ops_per_step(reqs, state) -> int:
    rows = state.rows_for(reqs)                               # first step assigns rows (once per request)
    logits = torch.randn(len(reqs), 40)
    with AtenOpCount() as count:
        rows = state.rows_for(reqs)
        state.record(rows, state.apply(logits, rows).argmax(-1))
    return count.n


def test_host_cost_per_step_does_not_grow_with_penalties():
    """Device ops launched per steady step: the same for 1 or 8 processed rows and for any mix of features."""
    counts = set()
    for n_pen, params in [(1, SamplingParams(presence_penalty=0.5)), (8, SamplingParams(presence_penalty=0.5)),
                          (8, SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1,
                                             logit_bias={3: 1.0}, min_tokens=2))]:
        reqs = [_req(i, [1, 2], [], params if i < n_pen else SamplingParams()) for i in range(8)]
        counts.add(_ops_per_step(reqs, PenaltyState(8, 40, "cpu", EOS)))
    assert len(counts) == 1, counts


def test_state_first_allocated_under_inference_mode_still_takes_host_updates():
    """The decode graphs allocate the state while capturing (under inference mode); assigning a request's row
    afterwards, outside it, writes the rows in place and must not hit inference-tensor errors."""
    from m3serve.engine.penalties import PenaltyState
    from m3serve.engine.request import Request
    st = PenaltyState(4, 50, "cpu", [2])
    with torch.inference_mode():
        st.ensure_allocated()
    req = Request(0, [1, 3, 5], SamplingParams(repetition_penalty=1.2, logit_bias={7: 1.5}))
    rows = st.row_ids_for([req])
    assert rows == [0] and bool(st.seen[0, 3]) and float(st.bias[0, 7]) == 1.5
