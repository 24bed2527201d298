"""Details a first run meets: `bench serve --help` shows its defaults, the Pareto chart keeps its labels inside
the axes and says "per GPU" only for a GPU server, `m3serve explain` says routing is off on CPU, the embedded
drafter resolves to an absolute path."""

from __future__ import annotations

import os

import pytest

from m3serve.bench import cli as bench_cli
from m3serve.targets.explain_cli import routing_note


def test_bench_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        bench_cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for piece in ("tokens generated per request (default: 128)", "sampling temperature (default: 0.0)",
                  "(default: fixed)", "(default: bench_serve.json)"):
        assert piece in out, piece


def _result(device, label, pts):
    return {"meta": {"label": label, "server_device": device},
            "results": [{"concurrency": c, "interactivity_x90": x, "total_tokens_per_s_per_gpu": y}
                        for c, x, y in pts]}


@pytest.mark.parametrize("device,per_gpu", [("cuda", True), ("cpu", False), (None, True)])
def test_pareto_labels_inside_and_the_y_axis_unit(device, per_gpu):
    pytest.importorskip("matplotlib")
    from m3serve.bench.plot import pareto_figure
    fig = pareto_figure([_result(device, "a", [(1, 50.0, 10.0), (2, 40.0, 19.0), (64, 3.0, 400.0)]),
                         _result("cuda", "b", [(1, 60.0, 12.0), (8, 20.0, 90.0)])])
    fig.canvas.draw()
    ax = fig.axes[0]
    box = ax.get_window_extent()
    labels = [t for t in ax.texts if t.get_text().startswith("c=")]
    assert len(labels) == 5
    for t in labels:
        e = t.get_window_extent()
        assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, t.get_text()
    assert ("GPU" in ax.get_ylabel()) is (per_gpu and device != "cpu")
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_explain_says_routing_is_off_on_cpu():
    assert "routing is off" in routing_note("cpu") and routing_note("cuda") is None


def test_embedded_drafter_is_absolute():
    from m3serve import embedded_drafter
    path = embedded_drafter()
    assert os.path.isabs(path) and os.path.isfile(os.path.join(path, "config.json"))


def test_tokenizer_loads_the_named_fast_class_as_auto_tokenizer_would(model_dir):
    """load_tokenizer skips AutoTokenizer's import cost; the tokenizer it returns behaves the same."""
    from transformers import AutoTokenizer

    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.tokenizer import load_tokenizer
    text = "Once upon a time <|user|> \u4e2d\u6587 \u00e9"
    for path in (DEFAULT_MODEL_DIR, model_dir):
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(auto)
        assert ours.encode(text) == auto.encode(text) and ours.chat_template == auto.chat_template
        assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id


def test_generate_streams_the_offline_text(capsys):
    """`m3serve generate` prints the prompt and exactly the offline API's completion (streamed by DecodeStream)."""
    import logging

    from m3serve import LLM, SamplingParams
    from m3serve.cli import main
    log = logging.getLogger("m3serve")
    saved = (list(log.handlers), log.level, log.propagate)     # the CLI installs its own handler: put it back
    try:
        assert main(["generate", "--prompt", "To be, or not", "--max-tokens", "12", "--speculative-tokens", "0"]) == 0
    finally:
        log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]
        log.setLevel(saved[1])
    out = capsys.readouterr().out
    want = LLM().generate("To be, or not", SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert out == "To be, or not" + want[0].outputs[0].text + "\n"
