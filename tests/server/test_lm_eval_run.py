"""lm-evaluation-harness 0.4.13 itself (when installed) runs a small local multiple-choice task and a
generate_until task through `local-completions` against the embedded model's server, its tokenizer remote
(/tokenizer_info, /tokenize, /detokenize). The multiple-choice accuracy is checked against the offline API's
own log-likelihood ranking of the same choices."""

from __future__ import annotations

import json
import math

import pytest

from m3serve import SamplingParams
from tests.server.vllm_http import EMBEDDED
from tests.server.vllm_http import embedded_ref_fixture, embedded_server_fixture  # noqa: F401 (fixtures ref, server)

pytestmark = pytest.mark.slow

DOCS = [{"question": "Once upon a", "choices": [" time", " dog", " seven"], "answer": 0},
        {"question": "To be, or not to", "choices": [" be", " eat", " blue"], "answer": 0},
        {"question": "The king of", "choices": [" England", " the", " purple"], "answer": 1},
        {"question": "Good night, sweet", "choices": [" prince", " table", " water"], "answer": 0}]

MC = """task: m3_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN = """task: m3_local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""


def _offline_choice(ref, doc) -> int:
    tok = ref.get_tokenizer()
    ctx = tok.encode(doc["question"], add_special_tokens=False)
    scores = []
    for c in doc["choices"]:
        ids = ctx + tok.encode(doc["question"] + c, add_special_tokens=False)[len(ctx):]
        out = ref.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        scores.append(sum(e[t].logprob for t, e in zip(ids[len(ctx):], out.prompt_logprobs[len(ctx):])))
    return max(range(len(scores)), key=scores.__getitem__)


def test_lm_eval_runs_local_tasks(server, ref, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")            # lm-eval's `api` extra
    from lm_eval.tasks import TaskManager
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "mc.yaml").write_text(MC.format(data=data))
    (tmp_path / "gen.yaml").write_text(GEN.format(data=data))
    res = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={EMBEDDED},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                   "num_concurrent=1,max_retries=1",
        tasks=["m3_local_mc", "m3_local_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=False)
    mc, gen = res["results"]["m3_local_mc"], res["results"]["m3_local_gen"]
    want = sum(_offline_choice(ref, d) == d["answer"] for d in DOCS) / len(DOCS)
    assert math.isclose(mc["acc,none"], want)
    outs = ref.generate([d["question"] for d in DOCS], SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]),
                        use_tqdm=False)
    greedy = sum(o.outputs[0].text == d["choices"][d["answer"]] for o, d in zip(outs, DOCS)) / len(DOCS)
    assert math.isclose(gen["exact_match,none"], greedy)
