import pytest

from bench.generate_main_job import parse_summary


def test_the_summary_line_is_read_field_by_field():
    err = ("warming up\n[64 tokens in 0.05 s, 1392.3 tok/s; load 6.3 s; finish: length; device cuda, "
           "torch.bfloat16; Eagle3 acceptance length 2.41]\n")
    assert parse_summary(err) == {"tokens": 64, "decode_s": 0.05, "tok_s": 1392.3, "load_s": 6.3,
                                  "finish": "length", "device": "cuda"}


def test_a_run_without_a_summary_raises_with_its_stderr():
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        parse_summary("Traceback ...\nRuntimeError: CUDA out of memory\n")
