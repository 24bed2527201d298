"""A server on the speculative engine exports the acceptance length in /metrics."""

from __future__ import annotations

import urllib.request

from tests.server.conftest import make_llm, serve


def test_metrics_report_speculation(model_dir):
    llm = make_llm(model_dir, speculative_config={"method": "eagle3", "model": None, "num_speculative_tokens": 2,
                                                  "forced_acceptance": 2.5})
    srv = serve(llm)
    try:
        body = b'{"model": "tiny-test", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0}'
        req = urllib.request.Request(f"{srv.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    values = {line.split()[0].split("{")[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("m3serve_spec_")}
    # forced acceptance 2.5 (fixed pattern): the emitted tokens per verify step average exactly 2.5 over a run
    # whose length is a multiple of the pattern; here we require the gauge to exist and sit in [2, 3].
    assert "m3serve_spec_acceptance_length" in values, sorted(values)
    assert 2.0 <= values["m3serve_spec_acceptance_length"] <= 3.0
    assert values.get("m3serve_spec_verify_steps", 0) >= 1
    # the batch-size policy (its default threshold): a request alone speculates
    assert values["m3serve_spec_disable_by_batch_size"] == 2
    assert values["m3serve_spec_policy_spec_steps_total"] >= 1 and values["m3serve_spec_policy_plain_steps_total"] == 0
