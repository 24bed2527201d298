from m3serve.benchmeta import changes_measured_code


def test_results_files_do_not_make_the_tree_dirty():
    assert not changes_measured_code("")
    assert not changes_measured_code(" M bench/results/eval/eval-kv-bf16-vs-fp8-cpu.json\n"
                                     " M bench/results/serve/serve-tiny-cpu.png\n")


def test_code_changes_make_the_tree_dirty():
    assert changes_measured_code(" M m3serve/llm.py\n")
    assert changes_measured_code(" M bench/results/serve/serve-tiny-cpu.json\nM  bench/decode.py\n")


def test_a_renamed_code_file_is_a_change():
    assert changes_measured_code("R  m3serve/a.py -> m3serve/b.py\n")
