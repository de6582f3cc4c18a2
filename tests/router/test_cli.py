import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies.drafters import BENCHED_KINDS, KINDS, SERVED_KINDS, DrafterConfig
from router.cli import _drafters, build_parser, main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_generate_prints_text_and_a_timing_line(capsys, loaded):
    code, out, err = _run(capsys, "generate", "What is the capital of France?", "--max-tokens", "20")
    assert code == 0
    assert "Paris" in out
    assert "TTFT" in err and "ms/token" in err and "tok/s" in err


@pytest.mark.slow
def test_generate_json_is_one_object_scripts_can_use(capsys, loaded):
    code, out, _ = _run(capsys, "generate", "The sky is", "--raw", "--max-tokens", "5", "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["completion_tokens"] == len(payload["token_ids"]) == 5
    assert payload["finish_reason"] == "length"
    assert {"text", "ttft_s", "tpot_s", "tokens_per_s", "seed", "engine"} <= payload.keys()


@pytest.mark.slow
def test_generate_accepts_chat_messages_as_json(capsys, loaded):
    messages = json.dumps(
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
    )
    code, out, _ = _run(capsys, "generate", "--messages", messages, "--max-tokens", "10", "--json")
    assert code == 0 and "Paris" in json.loads(out)["text"]


@pytest.mark.slow
def test_generate_reads_chat_messages_from_a_file(capsys, loaded, tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "user", "content": "What is the capital of France?"}]))
    code, out, _ = _run(capsys, "generate", "--messages", str(path), "--max-tokens", "10")
    assert code == 0 and "Paris" in out


@pytest.mark.slow
def test_seeded_sampling_from_the_cli_reproduces(capsys, loaded):
    args = (
        "generate",
        "Tell me a story",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--max-tokens",
        "8",
        "--json",
    )
    first = json.loads(_run(capsys, *args)[1])
    second = json.loads(_run(capsys, *args)[1])
    assert first["token_ids"] == second["token_ids"] and first["seed"] == 3


@pytest.mark.slow
def test_speculative_generate_prints_text_timing_and_stats(capsys, loaded):
    prompt = "Repeat exactly: The Riverside library will close on March 3 for renovations."
    code, out, err = _run(capsys, "generate", prompt, "--speculative", "ngram", "--k", "4", "--max-tokens", "30")
    plain = _run(capsys, "generate", prompt, "--max-tokens", "30")[1]
    assert code == 0 and out == plain  # greedy: the very same text as plain decoding
    assert "[speculative ngram]" in err and "tok/s" in err
    assert "[ngram] k=4" in err and "α" in err and "mean accepted length" in err and "γ" in err


@pytest.mark.slow
def test_speculative_generate_json_carries_the_stats(capsys, loaded):
    argv = ("generate", "Hi", "--speculative", "early-exit", "--exit-layer", "2", "--max-tokens", "6", "--json")
    code, out, _ = _run(capsys, *argv)
    payload = json.loads(out)
    assert code == 0 and payload["engine"] == "speculative early-exit"
    stats = payload["speculation"]
    assert stats["drafter"] == "early-exit-2" and stats["k_mode"] == "auto"
    assert {"acceptance_rate", "mean_accepted_length", "gamma", "accepted_per_position", "k_history"} <= stats.keys()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "medusa", "early-exit-adapter"])
def test_shipped_trained_drafters_work_out_of_the_box(capsys, loaded, kind):
    plain = _run(capsys, "generate", "Name three fruits.", "--max-tokens", "12")[1]
    code, out, err = _run(capsys, "generate", "Name three fruits.", "--max-tokens", "12", "--speculative", kind)
    assert code == 0 and out == plain
    assert f"[{kind}] k=auto" in err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--speculative", "eagle", "--drafter-weights", "/no/such/dir"], "no trained eagle drafter at /no/such/dir"),
        (["--max-tokens", "-3"], "max_tokens: Input should be greater than or equal to 1 (got -3)"),
        (["--temperature", "-1"], "sampling.temperature: Input should be greater than or equal to 0"),
        (["--top-p", "0"], "sampling.top_p: Input should be greater than 0"),
        (["--top-p", "1.5"], "sampling.top_p: Input should be less than or equal to 1"),
        (["--dtype", "float16"], "unknown dtype 'float16': use one of float32, bfloat16"),
        (["--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
        (["--messages", '[{"role": "user"}]'], "messages.0.content: Field required"),
        (["--messages", "not json"], "neither a JSON list, an existing file, nor -"),
        (["--raw", "--system", "be brief"], "--system needs the chat template: drop --raw"),
        (["--speculative", "ngram", "--k", "two"], "--k takes a non-negative integer or 'auto' (got 'two')"),
        (["--speculative", "ngram", "--k", "40"], "k must be an integer from 0 to 32 or 'auto' (got 40)"),
        (["--k", "3"], "--k needs --speculative"),
        (["--speculative", "ngram", "--ngram-min", "5"], "ngram_min (5) must not exceed ngram_max (4)"),
        (["--speculative", "early-exit", "--exit-layer", "99"], "exit layer must be between 1 and 29"),
        (["--speculative", "model", "--draft-dtype", "float32"], "the draft model is the target itself"),
    ],
)
def test_bad_generate_arguments_exit_2_with_what_to_change(capsys, argv, hint):
    prompt = [] if "--messages" in argv else ["hello"]
    code, _, err = _run(capsys, "generate", *prompt, *argv)
    assert code == 2
    assert hint in err


def test_missing_prompt_is_explained(capsys):
    code, _, err = _run(capsys, "generate")
    assert code == 2 and "give a prompt" in err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "specroute"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert all(command in result.stdout for command in ("setup", "generate", "bench"))


@pytest.mark.parametrize("command", [["generate"], ["profile"], ["bench", "spec"], ["bench", "model-fit"]])
def test_drafter_flags_come_from_the_registry_and_its_config(command):
    """Every command that builds drafters offers the same flags, with DrafterConfig's defaults."""
    parser = build_parser()
    args = parser.parse_args([*command, *(["x"] if command == ["generate"] else [])])
    defaults = DrafterConfig()
    for name in DrafterConfig.model_fields.keys() - {"kind"}:
        assert getattr(args, name) == getattr(defaults, name), name
    given = parser.parse_args([*command, "--ngram-max", "6", "--drafter-weights", "w/", "--draft-dtype", "float32"])
    assert (given.ngram_max, given.weights, given.draft_dtype) == (6, "w/", "float32")


def test_drafter_choices_and_defaults_are_the_registrys(capsys):
    parser = build_parser()
    # serve and profile: unnamed drafters are the engine's default (every served kind on torch)
    assert parser.parse_args(["serve"]).drafters is None
    assert _drafters(parser.parse_args(["profile"])) == list(SERVED_KINDS)
    assert _drafters(parser.parse_args(["profile", "--engine", "llamacpp"])) == ["ngram"]
    assert _drafters(parser.parse_args(["profile", "--drafters", "model"])) == ["model"]
    assert parser.parse_args(["bench", "spec"]).drafters == ",".join(BENCHED_KINDS)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--speculative", "jacobi"])
    err = capsys.readouterr().err
    assert "invalid choice: 'jacobi'" in err and all(f"'{kind}'" in err for kind in KINDS)


def test_serve_turns_prefix_caching_off_on_request(monkeypatch):
    from router import serve_cmd

    served = []
    monkeypatch.setattr(serve_cmd, "serve_forever", lambda settings, *rest: served.append(settings) or 0)
    parser = build_parser()
    for flags, expected in (([], True), (["--no-prefix-caching"], False)):
        args = parser.parse_args(["serve", *flags])
        assert args.handler(args) == 0
        assert served[-1].backend.prefix_caching is expected
