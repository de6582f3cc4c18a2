"""The `specroute` command line. Heavy imports (torch, transformers) happen inside the
commands that need them, so `specroute --help` answers at once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from policies.drafters import BENCHED_KINDS, KINDS, TRAINED_KINDS, DrafterConfig, option_kinds
from policies.engines import (
    DEFAULT_QUANTIZED_WEIGHTS,
    ENGINE_CHOICES,
    ENGINE_SUMMARIES,
    ENGINES,
    GGUF_WEIGHTS,
    default_drafters,
)
from policies.errors import UserError
from policies.quantization import QUANT_CHOICES, UNCALIBRATED
from policies.replicas import ReplicaRouting
from router.load_models import LoadWorkload

if TYPE_CHECKING:
    from backends.generation import GenerationResult

DEFAULT_PROMPT_HELP = "sent as one user chat message unless --raw is given"
# What a validation error is about, by the pydantic model that raised it.
INPUT_NAMES = {
    "GenerationRequest": "request",
    "ProfileConfig": "profile settings",
    "ModelFitConfig": "model-fit settings",
    "BenchSpecConfig": "bench settings",
    "BenchPlainConfig": "bench settings",
    "DrafterConfig": "drafter settings",
    "ServiceSettings": "service settings",
    "BackendSettings": "backend settings",
    "LoadConfig": "load settings",
    "FaultsConfig": "faults settings",
    "TrainConfig": "train-drafter settings",
    "ReportConfig": "report settings",
}


class UsageError(UserError):
    """Command-line arguments that do not fit together."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValidationError as exc:
        what = INPUT_NAMES.get(exc.title, "input")
        print(f"error: invalid {what}:\n{format_validation_error(exc)}", file=sys.stderr)
    except UserError as exc:  # anything else is a bug and keeps its traceback
        print(f"error: {exc}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specroute", description="Latency-optimization advisor and router")
    commands = parser.add_subparsers(dest="command", required=True)
    setup = commands.add_parser("setup", help="fetch and convert the embedded default model (once)")
    setup.add_argument("--force", action="store_true", help="download and convert again")
    setup.set_defaults(handler=run_setup)
    generate = commands.add_parser("generate", help="generate a completion (plain, or speculative with a drafter)")
    _add_generate_args(generate)
    _add_speculative_args(generate)
    generate.set_defaults(handler=run_generate)
    bench = commands.add_parser("bench", help="benchmarks that print side-by-side ratios")
    benches = bench.add_subparsers(dest="bench", required=True)
    subcommands = [
        (
            benches,
            "plain",
            "plain engine vs transformers generate; batch scaling; bandwidth",
            _add_bench_plain_args,
            run_bench_plain,
        ),
        (
            benches,
            "spec",
            "speculative vs plain per prompt category, and vs transformers",
            _add_bench_spec_args,
            run_bench_spec,
        ),
        (
            benches,
            "invariance",
            "does greedy output depend on the pass width or the batch? width-invariant passes on and off",
            _add_bench_invariance_args,
            run_bench_invariance,
        ),
        (
            benches,
            "model-fit",
            "cost model's predicted speedup vs measured, by category, k and batch",
            _add_model_fit_args,
            run_bench_model_fit,
        ),
        (
            commands,
            "profile",
            "measure cost curves and acceptance on this machine; fit α",
            _add_profile_args,
            run_profile,
        ),
        (
            commands,
            "advise",
            "which backend a request should go to, and why (runs nothing)",
            _add_advise_args,
            run_advise,
        ),
        (
            commands,
            "serve",
            "start the OpenAI-compatible service (Ray Serve, three backends) and print its URL",
            _add_serve_args,
            run_serve,
        ),
        (
            commands,
            "train-drafter",
            "train an EAGLE head, Medusa heads or an early-exit adapter on the target's own outputs",
            _add_train_drafter_args,
            run_train_drafter,
        ),
        (
            commands,
            "report",
            "a capacity-planning report (HTML, plots, JSON) for a workload, from what was measured",
            _add_report_args,
            run_report,
        ),
        (
            benches,
            "load",
            "closed-loop load on the running service: router vs every backend forced, per concurrency",
            _add_bench_load_args,
            run_bench_load,
        ),
        (
            benches,
            "faults",
            "faults under load on a service it starts: replicas SIGKILLed, an invalid policy deployed; vs undisturbed",
            _add_bench_faults_args,
            run_bench_faults,
        ),
    ]
    for parent, name, help_text, add_args, handler in subcommands:
        sub = parent.add_parser(name, help=help_text)
        add_args(sub)
        sub.set_defaults(handler=handler)
    return parser


def _add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `DrafterConfig` option, declared from the config itself: its default, its
    description and the kinds (from the registry) that read it."""
    group = parser.add_argument_group("drafter options")
    for name, field in DrafterConfig.model_fields.items():
        if name == "kind":
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = str(extra.get("flag", "--" + name.replace("_", "-")))
        kinds = ", ".join(option_kinds(name))
        group.add_argument(
            flag, dest=name, type=type(field.default), default=field.default, help=f"{kinds}: {field.description}"
        )


def _drafter_options(args: argparse.Namespace, kind: str | None = None) -> DrafterConfig:
    """The drafter options the flags give (and the kind, if one is named)."""
    options = {name: getattr(args, name) for name in DrafterConfig.model_fields if name != "kind"}
    return DrafterConfig(**options, **({"kind": kind} if kind is not None else {}))


def _add_drafters_flag(parser: argparse.ArgumentParser, default: tuple[str, ...] | None, what: str) -> None:
    """--drafters: a comma-separated list of registry kinds, defaulting to one of its sets (None:
    the engine's, `default_drafters`)."""
    if default is None:
        shown = "; ".join(f"{e}: {','.join(default_drafters(e))}" for e in ENGINES)
        help = f"comma-separated {what} ({', '.join(KINDS)}; default {shown})"
        parser.add_argument("--drafters", default=None, help=help)
        return
    parser.add_argument("--drafters", default=",".join(default), help=f"comma-separated {what} ({', '.join(KINDS)})")


def _drafters(args: argparse.Namespace) -> list[str]:
    """--drafters as given, else the engine's default."""
    return _str_list(args.drafters) if args.drafters else list(default_drafters(args.engine))


def _add_quantized_drafters_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantized-drafters",
        help="comma-separated drafters the quantized backend speculates with, among --drafters (ngram, model; "
        "none: it decodes plain; default: the engine's: ngram on llamacpp, none on torch)",
    )


def _quantized_drafters(args: argparse.Namespace) -> list[str] | None:
    """--quantized-drafters as given ('none': none), else None: the engine's default."""
    given = args.quantized_drafters
    return None if given is None else [] if given == "none" else _str_list(given)


def _add_profile_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64", help="batch sizes of the cost curves")
    parser.add_argument("--max-width", type=int, default=9, help="widest pass measured (k up to max-width - 1)")
    parser.add_argument("--prefill-lengths", default="16,64,256,1024", help="prompt lengths timed for TTFT")
    parser.add_argument(
        "--contexts",
        default="64,512,1024,2048",
        help="cached-context lengths the context curve times passes at (the curves' own 192 is added)",
    )
    parser.add_argument(
        "--context-budget", type=float, default=150.0, help="seconds the context curve may take (0: not measured)"
    )
    _add_drafters_flag(parser, None, "drafters to profile")
    _add_engine_flag(parser)
    _add_quantized_drafters_flag(parser)
    parser.add_argument(
        "--quantized-weights",
        default=DEFAULT_QUANTIZED_WEIGHTS,
        help=f"with --engine llamacpp: comma-separated weight types measured for the quantized backend, the served "
        f"one first ({', '.join(w for w in GGUF_WEIGHTS if w != 'file')}; none: no quantized backend)",
    )
    parser.add_argument("--acceptance-k", type=int, default=8, help="k each drafter runs at to measure acceptance")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt in the acceptance runs")
    parser.add_argument("--categories", help="comma-separated categories (default: all)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per category (default: all)")
    parser.add_argument(
        "--training-prompts",
        type=int,
        default=100,
        help="prompts per category of the larger training set also measured, for the α/ρ predictor only (0: none)",
    )
    _add_drafter_args(parser)
    parser.add_argument(
        "--acceptance",
        default="auto",
        choices=["auto", "measure", "shipped"],
        help="auto: take acceptance shipped for this model when it fits (the embedded default in float32 or "
        "bfloat16), else measure it; measure: always; shipped: refuse to measure it",
    )
    parser.add_argument(
        "--ship-acceptance",
        action="store_true",
        help="also write the measured acceptance and int8 agreement as the ones specroute ships for the embedded "
        "default in this dtype (float32 or bfloat16; implies --acceptance measure); with --engine llamacpp, its "
        "weights' measured quality, added to the float32 seed (a first start on llama.cpp then skips measuring it)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help=f"comma-separated quantization methods to measure, the served one first ({', '.join(QUANT_CHOICES)}; "
        "auto: the weight-only method the weights fit; 'none': no quantized backend)",
    )
    parser.add_argument("--out", help="where the profile goes (default: under SPECROUTE_HOME, per model)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON instead of the report")


def _add_advise_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help=f"the prompt; {DEFAULT_PROMPT_HELP}")
    parser.add_argument("--messages", help="chat messages as a JSON list, a JSON file path, or - for stdin")
    parser.add_argument("--system", help="system message placed before the prompt")
    parser.add_argument("--raw", action="store_true", help="the prompt is raw text, no chat template")
    parser.add_argument("--category", help="the prompt's category, if known (chat, code, summarization, ...)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests decoding at once, this one included")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens the request asks for (its decode length)")
    parser.add_argument("--model", default="embedded", help="the model the profile belongs to")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=AUTO_DTYPE_HELP)
    parser.add_argument("--device", default="cpu", help="the device the profile was measured on (cpu or cuda)")
    parser.add_argument("--profile", help="profile path (default: the model's under SPECROUTE_HOME)")
    parser.add_argument("--policy", help="policy YAML (default: the built-in defaults, as in deploy/policy.yaml)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


DTYPE_CHOICES = ("auto", "float32", "bfloat16")
AUTO_DTYPE_HELP = (
    "the target's dtype; auto (default): the exact dtype this machine's profiles predict faster — bfloat16 with "
    "width-invariant passes where the CPU runs it natively and it wins, else float32"
)


def _add_model_fit_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser)
    parser.add_argument("--profile", help="profile path (default: the model's under SPECROUTE_HOME)")
    parser.add_argument("--drafter", default=KINDS[0], choices=KINDS, help="the drafter whose fit is measured")
    parser.add_argument("--categories", help="comma-separated categories (default: all)")
    parser.add_argument("--ks", default="1,2,4,8", help="comma-separated fixed k values")
    parser.add_argument("--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens generated per row (EOS ignored; timed while each has room)"
    )
    parser.add_argument("--prompts", type=int, default=2, help="prompts per category")
    parser.add_argument(
        "--prompt-set",
        choices=["heldout", "project"],
        default="heldout",
        help="prompts run: the held-out set (neither the profile nor the predictor saw it; default) or the project's",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of every engine per batch (the fastest counts)")
    parser.add_argument(
        "--predictor-prompts",
        type=int,
        default=None,
        help="prompts per category whose answers score the α/ρ predictor (default: every prompt of the set; 0: none)",
    )
    _add_drafter_args(parser)
    parser.add_argument("--out", default="bench-model-fit.json", help="where the JSON results go ('-' for none)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the tables")


def _add_quantize_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantize",
        choices=UNCALIBRATED,
        help="bench the quantized backend's target: the model quantized weight-only (auto: the method its weights fit)",
    )


def _add_model_args(parser: argparse.ArgumentParser, dtype: str = "float32") -> None:
    parser.add_argument("--model", default="embedded", help="'embedded', a local directory, a .gguf file or a HF id")
    if dtype == "auto":
        parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=AUTO_DTYPE_HELP)
    else:
        parser.add_argument("--dtype", default=dtype, help="float32 (exact) or bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")


def _add_engine_flag(parser: argparse.ArgumentParser, choices: tuple[str, ...] = ENGINES) -> None:
    summaries = "; ".join(f"{name}: {summary}" for name, summary in ENGINE_SUMMARIES.items())
    if "auto" in choices:
        summaries += "; auto: the one this machine's profiles predict faster whose weights meet the quality floor"
    parser.add_argument(
        "--engine", default="torch", choices=choices, help=f"what runs the target's passes ({summaries})"
    )
    parser.add_argument(
        "--gguf-weights",
        default="file",
        choices=GGUF_WEIGHTS,
        help="with --engine llamacpp: the .gguf file's own weights, or the file requantized by llama.cpp to one type "
        "(made once under SPECROUTE_HOME; each type's quality against the float target: bench plain)",
    )


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help=f"the prompt; {DEFAULT_PROMPT_HELP}")
    parser.add_argument("--raw", action="store_true", help="complete the prompt as raw text, no chat template")
    parser.add_argument("--system", help="system message placed before the prompt")
    parser.add_argument("--messages", help="chat messages as a JSON list, a JSON file path, or - for stdin")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens generated (EOS, --stop end earlier)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: top tokens up to this mass")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    parser.add_argument("--seed", type=int, default=None, help="seeds sampling, so a sampled answer reproduces")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_model_args(parser)
    _add_engine_flag(parser)


def _add_speculative_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative", choices=KINDS, help="draft with this drafter (default: plain)")
    group.add_argument("--k", help="drafted tokens per step: an integer, or auto (default)")
    group.add_argument("--k-max", type=int, default=8, help="largest k that --k auto may choose")
    _add_drafter_args(parser)


def _add_bench_plain_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens generated per request")
    parser.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of ours vs generate")
    parser.add_argument(
        "--gguf-weights",
        default="file,Q4_0,Q8_0,F16",
        help=f"comma-separated weight types the llama.cpp section runs ({', '.join(GGUF_WEIGHTS)}; file: as shipped)",
    )
    parser.add_argument(
        "--quality-prompts", type=int, default=2, help="held-out prompts per category each weight type's quality reads"
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    _add_model_args(parser)
    _add_quantize_flag(parser)


def _add_bench_invariance_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=2, help="held-out prompts per category")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--batches", default="2,4,8", help="comma-separated batch sizes rows are decoded in")
    parser.add_argument("--drafter", default="ngram", choices=KINDS, help="the speculative loop's drafter")
    parser.add_argument(
        "--k", default="auto", help="the speculative loop's k: auto, or an integer (every width verified)"
    )
    parser.add_argument("--categories", help="comma-separated held-out categories (default: all)")
    parser.add_argument("--out", default="bench-invariance.json", help="where the JSON results go ('-' for none)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    _add_model_args(parser)
    _add_quantize_flag(parser)
    _add_engine_flag(parser)


def _add_bench_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=96, help="upper bound per request (EOS ends earlier)")
    parser.add_argument("--categories", help="comma-separated categories (default: all)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument(
        "--prompt-set",
        choices=["heldout", "project"],
        default="heldout",
        help="prompts timed: the held-out set (never tuned on; default) or the project's own",
    )
    _add_drafters_flag(parser, BENCHED_KINDS, "drafters to bench")
    parser.add_argument("--fixed-k", default="4", help="comma-separated fixed k values each drafter also runs at")
    parser.add_argument("--k-max", type=int, default=8, help="largest k that auto may choose")
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="start auto k with no acceptance map (default: fit each drafter's on the project set first)",
    )
    _add_drafter_args(parser)
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument(
        "--tile-width",
        type=int,
        help="bfloat16/float16: positions of every width-invariant pass (a lookahead block must fit in it; "
        "default: the step loop's tile_width)",
    )
    parser.add_argument("--out", default="bench-spec.json", help="where the JSON results go ('-' for none)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    _add_model_args(parser)
    _add_quantize_flag(parser)
    _add_engine_flag(parser)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it: set an API key)")
    parser.add_argument("--port", type=int, default=8000, help="the port the service listens on")
    parser.add_argument("--profile", help="profile JSON (default: SPECROUTE_HOME/profiles/…; measured if missing)")
    parser.add_argument("--policy", help="policy YAML (default: the built-in policy, as in deploy/policy.yaml)")
    parser.add_argument("--max-batch", type=int, default=32, help="most requests one backend batch takes")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt in full (default: prompts start from KV blocks earlier requests computed)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas of each backend (requests spread by prefix affinity, then load; default 1)",
    )
    parser.add_argument(
        "--max-imbalance",
        type=int,
        default=ReplicaRouting().max_imbalance,
        help="most requests more than the least-loaded replica that a replica holding the prompt's prefix may "
        "have and still get it",
    )
    _add_drafters_flag(parser, None, "drafters the speculative backend loads")
    _add_quantized_drafters_flag(parser)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $SPECROUTE_API_KEY)")
    _add_engine_flag(parser, ENGINE_CHOICES)
    parser.add_argument(
        "--quantized-weights",
        default=DEFAULT_QUANTIZED_WEIGHTS,
        choices=[w for w in GGUF_WEIGHTS if w != "file"],
        help="with --engine llamacpp: the quantized backend serves the .gguf file requantized to this type (its "
        "quality against the float target measured by the profile and held to the policy's floor)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANT_CHOICES,
        help="the quantized backend's method (auto: int4-weight-only for weights on a group-32 4-bit grid, as GGUF "
        "Q4 checkpoints are, else int8-weight-only)",
    )
    _add_model_args(parser, dtype="auto")


def _add_bench_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running service")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated closed-loop levels")
    parser.add_argument(
        "--request-rate", help="comma-separated requests/s: an open loop (Poisson arrivals) instead of --concurrency"
    )
    parser.add_argument("--modes", default="auto,speculative,plain,quantized", help="router (auto) and forced backends")
    parser.add_argument(
        "--batching", default="continuous", help="continuous, static or both (static,continuous): the A/B baseline"
    )
    parser.add_argument("--join-probe", action="store_true", help="time a short request joining a busy backend")
    parser.add_argument("--seed", type=int, default=0, help="seeds the open loop's arrival times")
    parser.add_argument(
        "--workload",
        choices=get_args(LoadWorkload),
        default="independent",
        help="independent prompts; shared-prefix: one long shared document before each; multi-turn: each client "
        "continues its conversation (closed loop)",
    )
    parser.add_argument("--requests", type=int, help="requests per cell (default: max(8, 2 × c) or ~20 s of arrivals)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request asks for")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--categories", help="comma-separated prompt categories (default: all)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="SLO: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0, help="SLO: time per output token at most this")
    parser.add_argument("--api-key", help="Bearer key, if the service needs one")
    parser.add_argument("--out", default="bench-load.json", help="where the JSON results go ('-' for none)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def _add_bench_faults_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1000, help="requests per run (undisturbed, then faulted)")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens each request asks for")
    parser.add_argument(
        "--faults",
        default="speculative,plain,quantized,policy",
        help="in this order: SIGKILL a backend's replica (speculative, plain, quantized), deploy an invalid policy",
    )
    parser.add_argument(
        "--routes",
        default="auto",
        help="requests cycle through these: auto (the router decides) and backends forced, e.g. "
        "auto,speculative,plain,quantized so every kill meets requests in flight",
    )
    parser.add_argument("--profile", help="profile JSON (default: SPECROUTE_HOME/profiles/…; measured if missing)")
    parser.add_argument("--port", type=int, default=8000, help="port of the service the bench starts")
    parser.add_argument("--out", default="bench-faults.json", help="where the JSON results go ('-' for none)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def _add_train_drafter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=TRAINED_KINDS, help="the drafter to train")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time budget (data generation excluded)")
    parser.add_argument("--out", help="directory for <kind>.safetensors + .json (default: SPECROUTE_HOME/drafters/…)")
    parser.add_argument("--prompts", type=int, help="use only this many training prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest self-distilled answer")
    parser.add_argument("--draft-vocab", type=int, default=16384, help="tokens the drafter may propose; 0 = all")
    parser.add_argument("--heads", type=int, default=4, help="medusa: number of heads")
    parser.add_argument("--exit-layer", type=int, default=8, help="early-exit-adapter: target layers under the adapter")
    parser.add_argument("--lr", type=float, default=1e-3, help="the optimizer's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt pick, initialisation and batches")
    parser.add_argument("--data-dir", help="self-distillation cache (default: SPECROUTE_HOME/drafter-data)")
    _add_model_args(parser)


def run_train_drafter(args: argparse.Namespace) -> int:
    from backends.models import load_model
    from backends.training.train import TrainConfig, render_card, train_drafter

    config = TrainConfig(
        kind=args.kind,
        minutes=args.minutes,
        out=Path(args.out) if args.out else None,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        draft_vocab=args.draft_vocab,
        heads=args.heads,
        exit_layer=args.exit_layer,
        lr=args.lr,
        seed=args.seed,
        data_root=Path(args.data_dir) if args.data_dir else None,
    )
    _quiet_model_loading()
    loaded = load_model(args.model, args.dtype, args.device, args.threads)
    path, card = train_drafter(config, loaded, log=lambda line: print(line, file=sys.stderr))
    print(render_card(card))
    print(f"\nweights: {path}\ncard:    {path.with_suffix('.json')}")
    print(f'use it:  specroute generate --speculative {card.kind} --drafter-weights {path.parent} "PROMPT"')
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from backends.deployments import BackendSettings
    from router.serve_cmd import serve_forever
    from router.service import ServiceSettings

    backend = BackendSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads or 1,  # three replicas share the cores: one torch thread each unless told
        max_batch=args.max_batch,
        prefix_caching=not args.no_prefix_caching,
        quantization=args.quantization,
        engine=args.engine,
        gguf_weights=args.gguf_weights,
        quantized_weights=args.quantized_weights,
        quantized_drafters=_quantized_drafters(args),
        # unnamed: the engine's default drafters, once an `auto` engine is decided (ServiceSettings.with_engine)
        **({"drafters": _str_list(args.drafters)} if args.drafters else {}),
    )
    if args.replicas < 1 or args.max_imbalance < 0:
        got = f"{args.replicas}, {args.max_imbalance}"
        raise UsageError(f"--replicas must be >= 1 and --max-imbalance >= 0 (got {got})")
    routing = ReplicaRouting(max_imbalance=args.max_imbalance)
    settings = ServiceSettings(
        backend=backend, profile=args.profile, api_key=args.api_key, replicas=args.replicas, replica_routing=routing
    )
    settings = settings.fitted_to(os.cpu_count() or 1)
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port must be 1-65535 (got {args.port})")
    return serve_forever(settings, args.host, args.port, args.policy)


def run_bench_load(args: argparse.Namespace) -> int:
    import asyncio

    from router.bench_load import run_load
    from router.load_models import LoadConfig
    from router.load_report import render_load

    config = LoadConfig(
        url=args.url,
        api_key=args.api_key,
        concurrency=_int_list(args.concurrency, "--concurrency"),
        request_rates=_float_list(args.request_rate, "--request-rate") if args.request_rate else None,
        modes=_str_list(args.modes),
        batching=_str_list(args.batching),
        join_probe=args.join_probe,
        seed=args.seed,
        workload=args.workload,
        requests_per_level=args.requests,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        categories=_str_list(args.categories) if args.categories else None,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
    )
    report = asyncio.run(run_load(config))
    return _print_report(args, report, render_load)


def run_bench_faults(args: argparse.Namespace) -> int:
    from router.bench_faults import run_faults
    from router.fault_models import FaultsConfig, render_faults

    config = FaultsConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        faults=_str_list(args.faults),
        routes=_str_list(args.routes),
        profile=args.profile,
        port=args.port,
    )
    _quiet_model_loading()
    report = run_faults(config, log=lambda line: print(line, file=sys.stderr))
    return _print_report(args, report, render_faults)


def run_setup(args: argparse.Namespace) -> int:
    from backends.embedded import prepare_embedded_model

    prepare_embedded_model(force=args.force)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from backends.generation import GenerationRequest
    from backends.models import load_model

    request = GenerationRequest(**_request_fields(args))
    _quiet_model_loading()
    loaded = load_model(args.model, args.dtype, args.device, args.threads)
    engine = _engine(args, loaded)
    result = engine.generate([request])[0]
    label = "plain" if args.speculative is None else f"speculative {args.speculative}"
    label += f" on {args.engine}" if args.engine != "torch" else ""
    label += f" ({args.gguf_weights} weights)" if args.gguf_weights != "file" else ""
    if args.json:
        payload = {**result.model_dump(), "tokens_per_s": result.tokens_per_s, "engine": label}
        print(json.dumps(payload))
    else:
        print(result.text)
        print(timing_line(result, label), file=sys.stderr)
        if result.speculation is not None:
            print(result.speculation.summary(), file=sys.stderr)
    return 0


def _engine(args: argparse.Namespace, loaded: object) -> object:
    """The plain backend's step loop (width-invariant where the dtype needs it, so its tokens are
    the speculative engine's), or the speculative engine with the drafter the flags describe."""
    from backends.scheduler import LoopSettings, Scheduler

    settings = LoopSettings(engine=args.engine, gguf_weights=args.gguf_weights)
    if args.speculative is None:
        if args.k is not None:
            raise UsageError(f"--k needs --speculative: pick a drafter ({', '.join(KINDS)})")
        return Scheduler(loaded, settings)
    from backends.speculative.engine import SpeculativeEngine
    from backends.speculative.factory import build_drafter

    drafter = build_drafter(_drafter_options(args, args.speculative), loaded)
    return SpeculativeEngine(loaded, drafter, k=parse_k(args.k or "auto"), k_max=args.k_max, settings=settings)


def parse_k(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise UsageError(f"--k takes a non-negative integer or 'auto' (got '{text}')")
    return k


def run_bench_plain(args: argparse.Namespace) -> int:
    from profiler.bench_plain import BenchPlainConfig, render_report, run_bench_plain

    config = BenchPlainConfig(
        **_model_fields(args),
        quantize=args.quantize,
        max_tokens=args.max_tokens,
        batch_sizes=_int_list(args.batches, "--batches"),
        rounds=args.rounds,
        gguf_weights=_str_list(args.gguf_weights),
        quality_prompts=args.quality_prompts,
    )
    _quiet_model_loading()
    report = run_bench_plain(config)
    print(report.model_dump_json(indent=2) if args.json else render_report(report))
    return 0


def run_bench_invariance(args: argparse.Namespace) -> int:
    from profiler.bench_invariance import BenchInvarianceConfig, render_report, run_bench_invariance

    config = BenchInvarianceConfig(
        **_model_fields(args),
        quantize=args.quantize,
        prompts_per_category=args.prompts,
        max_tokens=args.max_tokens,
        batch_sizes=_int_list(args.batches, "--batches"),
        drafter=args.drafter,
        k=parse_k(args.k),
        categories=_str_list(args.categories) if args.categories else None,
        engine=args.engine,
        gguf_weights=args.gguf_weights,
    )
    _quiet_model_loading()
    report = run_bench_invariance(config)
    return _print_report(args, report, render_report)


def run_bench_spec(args: argparse.Namespace) -> int:
    from profiler.bench_spec import BenchSpecConfig, render_report, run_bench_spec

    config = BenchSpecConfig(
        **_model_fields(args),
        quantize=args.quantize,
        max_tokens=args.max_tokens,
        categories=_str_list(args.categories) if args.categories else None,
        prompts_per_category=args.prompts,
        prompt_set=args.prompt_set,
        drafters=_str_list(args.drafters),
        fixed_k=_int_list(args.fixed_k, "--fixed-k"),
        k_max=args.k_max,
        calibrate=not args.no_calibrate,
        drafter=_drafter_options(args),
        transformers=not args.no_transformers,
        engine=args.engine,
        gguf_weights=args.gguf_weights,
        **({"tile_width": args.tile_width} if args.tile_width is not None else {}),
    )
    _quiet_model_loading()
    report = run_bench_spec(config)
    return _print_report(args, report, render_report)


def run_profile(args: argparse.Namespace) -> int:
    from profiler.profile_report import render_profile
    from profiler.profiling import SEED_DTYPES, ProfileConfig, default_profile_path, run_profile, write_seed

    config = ProfileConfig(
        **_model_fields(args),
        batches=_int_list(args.batches, "--batches"),
        max_width=args.max_width,
        prefill_lengths=_int_list(args.prefill_lengths, "--prefill-lengths"),
        contexts=_int_list(args.contexts, "--contexts"),
        context_budget_s=args.context_budget,
        drafters=_drafters(args),
        drafter=_drafter_options(args),
        engine=args.engine,
        gguf_weights=args.gguf_weights,
        gguf_quantized=[] if args.quantized_weights == "none" else _str_list(args.quantized_weights),
        quantized_drafters=_quantized_drafters(args),
        acceptance_k=args.acceptance_k,
        max_tokens=args.max_tokens,
        categories=_str_list(args.categories) if args.categories else None,
        prompts_per_category=args.prompts,
        training_prompts=args.training_prompts,
        acceptance="measure" if args.ship_acceptance else args.acceptance,
        quantization=[] if args.quantization == "none" else _str_list(args.quantization),
    )
    if args.ship_acceptance and (args.model not in ("embedded", "default") or args.dtype not in SEED_DTYPES):
        raise UsageError(
            f"--ship-acceptance is for the embedded default in {' or '.join(SEED_DTYPES)} (--model embedded --dtype …)"
        )
    _quiet_model_loading()
    profile = run_profile(config, log=lambda line: print(line, file=sys.stderr))
    path = Path(args.out) if args.out else default_profile_path(args.model, args.dtype, args.device, config.loop())
    profile.save(path)
    print(profile.model_dump_json(indent=2) if args.json else render_profile(profile))
    if not args.json:
        print(f"\nprofile written to {path}")
    if args.ship_acceptance:
        what = "the llama.cpp weights' quality" if config.engine == "llamacpp" else "acceptance"
        print(f"shipped {what} written to {write_seed(profile)}", file=sys.stderr)
    return 0


def run_advise(args: argparse.Namespace) -> int:
    from backends.embedded import EMBEDDED_NAME
    from backends.generation import GenerationRequest
    from backends.models import load_tokenizer, resolve_source
    from policies.config import default_policy, load_policy
    from policies.profile import Profile
    from profiler.profiling import default_profile_path
    from router.advise import Predictors, advise, render_advice, request_features
    from router.dtype_choice import decide_dtype

    if args.concurrency < 1:
        raise UsageError(f"--concurrency counts this request too: at least 1 (got {args.concurrency})")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    config = load_policy(args.policy) if args.policy else default_policy()
    choice = decide_dtype(args.model, args.dtype, args.device, args.profile, config)
    path = Path(args.profile) if args.profile else default_profile_path(args.model, choice.dtype, args.device)
    profile = Profile.load(path)
    request, tokenizer, predictors = None, None, None
    if args.prompt is not None or args.messages is not None:
        request = GenerationRequest(**_prompt_fields(args), max_tokens=args.max_tokens)
        kind, location = resolve_source(args.model)
        model_name = EMBEDDED_NAME if kind == "embedded" else location
        if profile.model.name != model_name:
            raise UsageError(
                f"{path} profiles {profile.model.name}, not {model_name}: pass --model for the profiled model "
                "(its tokenizer counts the prompt)"
            )
        tokenizer = load_tokenizer(args.model)
        predictors = Predictors.from_profile(profile) if profile.samples else None
    elif args.category is None:
        raise UsageError("give a prompt (or --messages), a --category, or both")
    features = request_features(request, args.category, profile, predictors, tokenizer, args.max_tokens)
    advice = advise(features, args.concurrency, profile, config, choice)
    print(advice.model_dump_json(indent=2) if args.json else render_advice(advice))
    return 0


def run_bench_model_fit(args: argparse.Namespace) -> int:
    from profiler.bench_model_fit import ModelFitConfig, render_model_fit, run_model_fit

    config = ModelFitConfig(
        **_model_fields(args),
        profile=args.profile,
        drafter=args.drafter,
        drafter_options=_drafter_options(args),
        categories=_str_list(args.categories) if args.categories else None,
        ks=_int_list(args.ks, "--ks"),
        batches=_int_list(args.batches, "--batches"),
        max_tokens=args.max_tokens,
        prompts_per_category=args.prompts,
        prompt_set=args.prompt_set,
        repeats=args.repeats,
        predictor_prompts=args.predictor_prompts,
    )
    _quiet_model_loading()
    report = run_model_fit(config)
    return _print_report(args, report, render_model_fit)


def _add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="workload YAML (see deploy/workload.yaml)")
    parser.add_argument("--out", required=True, help="directory for report.html, report.md, report.json, plots")
    parser.add_argument("--profile", help="profile JSON (default: the embedded model's under SPECROUTE_HOME)")
    parser.add_argument(
        "--load-results", action="append", default=[], help="`bench load` JSON, repeatable (default: ./bench-load.json)"
    )
    parser.add_argument("--bench-spec", help="`bench spec` JSON (default: ./bench-spec.json if present)")
    parser.add_argument("--model-fit", help="`bench model-fit` JSON (default: ./bench-model-fit.json if present)")
    parser.add_argument(
        "--compare-profile", action="append", default=[], help="another machine's profile to what-if (repeatable)"
    )
    parser.add_argument(
        "--no-other-engine",
        action="store_true",
        help="do not what-if the embedded model's profile on this machine's other engine (torch / llama.cpp) "
        "beside the default profile",
    )
    parser.add_argument("--policy", help="policy YAML (default: the built-in policy)")
    parser.add_argument("--requests", type=int, default=1200, help="simulated requests per what-if run")
    parser.add_argument("--max-replicas", type=int, default=64, help="most replicas the sizing tries")
    parser.add_argument("--seed", type=int, default=0, help="seeds the simulated traffic")
    parser.add_argument("--model", help="tokenizer for a JSONL workload's prompts (default: the embedded model)")
    parser.add_argument("--measure", action="store_true", help="run what is missing (profile, benches) first")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the service `--measure` loads, if running")
    parser.add_argument("--no-publish", action="store_true", help="do not make it the service's /report")


def run_report(args: argparse.Namespace) -> int:
    from router.report import latest_dir, publish
    from router.report.build import build_report
    from router.report.inputs import ReportConfig
    from router.report.render import write_report

    config = ReportConfig(
        workload=args.workload,
        out=args.out,
        profile=args.profile,
        load_results=args.load_results,
        bench_spec=args.bench_spec,
        model_fit=args.model_fit,
        compare_profiles=args.compare_profile,
        other_engine=not args.no_other_engine,
        policy=args.policy,
        requests=args.requests,
        max_replicas=args.max_replicas,
        seed=args.seed,
    )
    if args.measure:
        from router.report.measure import measure_missing

        _quiet_model_loading()
        config = measure_missing(config, args.url)
    report = build_report(config, progress=True, model=args.model)
    out = Path(args.out)
    write_report(report, out)
    for item in report.inputs:
        print(f"  {item.name:<16} {item.status}{f' ({item.path})' if item.path else ''}")
    print(f"\n{report.recommendation.headline}\n\nreport: {out / 'report.html'} (also report.md, report.json)")
    if not args.no_publish:
        print(f"published as the service's /report: {publish(out, latest_dir())}")
    return 0


def _print_report(args: argparse.Namespace, report: Any, render: Callable[[Any], str]) -> int:
    """A bench's tables (or JSON with --json), its JSON also to --out unless that is '-'."""
    if args.out != "-":
        Path(args.out).write_text(report.model_dump_json(indent=2))
    print(report.model_dump_json(indent=2) if args.json else render(report))
    if args.out != "-" and not args.json:
        print(f"\nresults written to {args.out}")
    return 0


def _model_fields(args: argparse.Namespace) -> dict[str, object]:
    """The model flags the bench configs share."""
    return {"model": args.model, "dtype": args.dtype, "device": args.device, "threads": args.threads}


def _str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _quiet_model_loading() -> None:
    """A converted model loads in ~0.1 s: its weight-loading progress bar is only noise on stderr."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _request_fields(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "stop": args.stop,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed},
        **_prompt_fields(args),
    }


def _prompt_fields(args: argparse.Namespace) -> dict[str, object]:
    """`prompt` or `messages` from the prompt, --raw, --system and --messages flags."""
    fields: dict[str, object] = {}
    if args.messages is not None:
        if args.prompt is not None:
            raise UsageError("give either a prompt or --messages, not both")
        fields["messages"] = _read_messages(args.messages)
    elif args.prompt is None:
        raise UsageError('give a prompt (e.g. specroute generate "What is the capital of France?") or --messages')
    elif args.raw:
        if args.system:
            raise UsageError("--system needs the chat template: drop --raw")
        fields["prompt"] = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        fields["messages"] = [*system, {"role": "user", "content": args.prompt}]
    return fields


def _read_messages(source: str) -> object:
    if source == "-":
        text = sys.stdin.read()
    elif source.lstrip().startswith("["):
        text = source
    elif Path(source).is_file():
        text = Path(source).read_text()
    else:
        raise UsageError(f"--messages '{source}' is neither a JSON list, an existing file, nor -")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--messages is not valid JSON ({exc}): pass a list of {{role, content}} objects") from exc


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise UsageError(f"{flag} takes comma-separated integers, e.g. 1,4,16 (got '{text}')") from exc


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise UsageError(f"{flag} takes comma-separated numbers, e.g. 0.5,1,2 (got '{text}')") from exc


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: the field path, what is wrong, and the value given."""
    lines = []
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"]) or "request"
        given = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
        lines.append(f"  {path}: {error['msg']}{given}")
    return "\n".join(lines)


def timing_line(r: GenerationResult, label: str = "plain") -> str:
    return (
        f"[{label}] {r.prompt_tokens} prompt + {r.completion_tokens} completion tokens · "
        f"TTFT {r.ttft_s * 1e3:.1f} ms · {r.tpot_s * 1e3:.1f} ms/token · "
        f"{r.tokens_per_s:.1f} tok/s · finish={r.finish_reason}"
    )


if __name__ == "__main__":
    sys.exit(main())
