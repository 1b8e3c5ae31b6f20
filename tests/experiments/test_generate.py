"""experiments/generate.py: smoke runs of language_model.py, then samples from them; bad inputs.

The trained runs are the session's shared smoke runs (conftest.py: one epoch of the AWD-LSTM's
and the Transformer's smoke presets); generate.py runs in-process.
"""

import json
import shutil

import pytest

from experiments import generate

# The fixture corpus's vocabulary (tests/data/fixtures/ptb), <eos> closing every line.
WORDS = {"the", "cat", "sat", "on", "mat", "dog", "a", "<unk>", "N", "years", "ago"}


@pytest.fixture(scope="module")
def run_dir(smoke_run):
    return smoke_run("awd_softmax")


def test_samples_are_printed_written_and_a_function_of_the_seed(run_dir, capsys):
    flags = ["--run_dir", str(run_dir), "--num_tokens", "7", "--prompt", "the cat sat"]
    texts = generate.main([*flags, "--num_samples", "3", "--top_p", "0.9"])
    assert len(texts) == 3 and len(set(texts)) > 1
    for text in texts:
        assert text.startswith("the cat sat")
        # 3 prompt words and 7 sampled tokens, each <eos> a line break.
        assert len(text.split()) + text.count("\n") <= 10 and set(text.split()) <= WORDS
    stdout = capsys.readouterr().out
    assert "== sample 3 ==" in stdout and texts[0] in stdout
    assert generate.main([*flags, "--num_samples", "3", "--top_p", "0.9"]) == texts
    assert generate.main([*flags, "--num_samples", "3", "--top_p", "0.9", "--seed", "1"]) != texts
    files = sorted((run_dir / "samples").glob("*_seed0*.txt"))
    assert len(files) == 2
    header, *body = files[0].read_text().splitlines()
    assert json.loads(header[2:])["top_p"] == 0.9 and body[0] == "== sample 1 =="
    # No prompt: a new sentence (conditioned on <eos>), not printed.
    (text,) = generate.main(["--run_dir", str(run_dir), "--num_tokens", "5", "--top_k", "1"])
    assert set(text.split()) <= WORDS


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt", "the zebra sat Cat"], "2 word(s) not in the run's vocabulary of 12: 'zebra', 'Cat'"),
        (["--top_k", "13"], "top_k must be in [1, 12]"),
    ],
)  # fmt: skip
def test_bad_requests_are_usage_errors(run_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--run_dir", str(run_dir), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_folder_that_is_not_a_language_model_run_is_refused(tmp_path, capsys):
    other = tmp_path / "rank_run"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"experiment": "rank", "config": {}}))
    for folder, message in [
        (tmp_path, "is not a language_model.py run folder: it has no config.json"),
        (other, "holds a run of rank, not of language_model.py"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            generate.main(["--run_dir", str(folder)])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (other / "checkpoints").exists() and not (other / "samples").exists()


def test_a_run_without_vocab_txt_reads_its_corpus_again(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("samples"))
    (copy / "vocab.txt").unlink()  # as a run made before the run loop wrote it
    flags = ["--num_tokens", "6", "--prompt", "the cat", "--num_samples", "2"]
    texts = generate.main(["--run_dir", str(run_dir), *flags])
    assert generate.main(["--run_dir", str(copy), *flags]) == texts


def test_samples_from_a_transformer_run_within_its_max_len(smoke_run, capsys):
    # The smoke Transformer takes 8 positions: a prompt of 2 and 7 samples fill its cache.
    run = smoke_run("transformer_softmax")
    flags = ["--run_dir", str(run), "--prompt", "the cat", "--num_samples", "3"]
    texts = generate.main([*flags, "--num_tokens", "7"])
    assert len(texts) == 3 and len(set(texts)) > 1
    for text in texts:
        assert text.startswith("the cat") and set(text.split()) <= WORDS
    with pytest.raises(SystemExit) as exit_info:
        generate.main([*flags, "--num_tokens", "8"])
    assert exit_info.value.code == 2
    assert "need 9 positions; the run's Transformer takes max_len 8" in capsys.readouterr().err


def test_bat_tau_truncates_a_softmax_runs_samples_and_refuses_a_mixtures(
    run_dir, smoke_run, capsys
):
    flags = ["--run_dir", str(run_dir), "--num_tokens", "5", "--num_samples", "2"]  # softmax
    plain = generate.main(flags)
    # Every token of 12 words has probability above 1e-6: none needs the LP, the draw is plain's.
    assert generate.main([*flags, "--bat_tau", "1e-6"]) == plain
    for text in generate.main([*flags, "--bat_tau", "0.3"]):
        assert set(text.split()) <= WORDS
    mixture_run = smoke_run("awd_mos")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--run_dir", str(mixture_run), "--bat_tau", "0.1"])
    assert exit_info.value.code == 2
    assert "bat_tau needs a plain softmax head" in capsys.readouterr().err
