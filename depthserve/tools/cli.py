"""`depthserve` command line: models, generate, serve (the HTTP server), chat (a terminal client)."""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import json
import socket
import sys
from dataclasses import fields
from pathlib import Path

from depthserve.archs import Command, architectures, knob_names
from depthserve.config import DEPTH_POLICIES, EngineArgs
from depthserve.loading.registry import BUILTIN_MODELS, DEFAULT_MODEL, resolve_model
from depthserve.server.connections import ConnectionLimits


class CLIParser(argparse.ArgumentParser):
    """Argument errors as one line (no usage dump) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Options' help with their defaults, except where there is nothing to show (flags, None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        nothing = action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS
        if nothing or "%(default)" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def fail(message: str) -> int:
    """A CLI error: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def _depth_json(text: str) -> dict:
    """--depth: a JSON object of depth knobs, checked before any model loads."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg} at character {exc.pos}): {text!r}; "
                                         "write e.g. '{\"loops\": 2}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"loops\": 2}}', got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="built-in name, .gguf file, checkpoint dir or Hugging Face Hub id (org/name)")
    parser.add_argument("--revision", default=None,
                        help="branch, tag or commit of a Hub model id (default: main)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="activations and cache dtype (auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16 "
                             "or AMX, float32 on other CPUs)")
    parser.add_argument("--quantization", default=EngineArgs.quantization, choices=["auto", "none", "gguf", "int8", "int4"],
                        help="CPU weight-only quantization (auto: a GGUF in its own 4-bit format when activations "
                             "are bfloat16; gguf: that whatever the dtype; none: dequantized weights; int8/int4: "
                             "quantize at load)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (CUDA when present)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default and ceiling: the model's own)")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=None,
                        help="memory for the KV cache pages (default: 1 GiB on CPU, 60%% of free memory on CUDA)")
    parser.add_argument("--block-size", type=int, default=EngineArgs.block_size, help="tokens per cache page")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens,
                        help="token budget of one engine step (default: 512 on CPU, 8192 on CUDA)")
    parser.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs,
                        help="sequences running at once")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=EngineArgs.long_prefill_token_threshold,
                        help="a sequence prefilling more tokens is long: its chunks are capped, it gives way to "
                             "short prompts (default: 128 on CPU, 2048 on CUDA; 0: none is, no cap)")
    parser.add_argument("--long-prefill-chunk-tokens", type=int, default=EngineArgs.long_prefill_chunk_tokens,
                        help="most tokens of a long prefill's chunk at context 0, fewer as its context grows "
                             "(default: 32 on CPU, the threshold on CUDA)")
    parser.add_argument("--long-prefill-context-scale", type=int, default=EngineArgs.long_prefill_context_scale,
                        help="a long prefill's chunk at context c takes at most chunk_tokens / (1 + c / this) "
                             "tokens (default: 1024 on CPU, 0 on CUDA: no shrinking)")
    parser.add_argument("--max-long-partial-prefills", type=int, default=EngineArgs.max_long_partial_prefills,
                        help="long prompts prefilling at once; later long ones wait while shorter ones go ahead")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="do not share cached prompt blocks between requests")
    parser.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                        help="prefill each prompt in one step")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="run every step eagerly (--no-enforce-eager: compile decode steps at static "
                             "shapes; default: compiled on CUDA, eager on CPU)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=EngineArgs.cuda_graphs,
                        help="on CUDA, replay each batch size's compiled decode step as a captured CUDA graph")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="compiled decode steps a greedy decode-only batch runs per engine step, each token "
                             "fed to the next on the device (default: 8 with CUDA graphs, else 1)")
    parser.add_argument("--kernel-backend", default=EngineArgs.kernel_backend, choices=["auto", "torch", "triton"],
                        help="auto: Triton kernels on CUDA, torch otherwise; torch or triton: that one everywhere")
    parser.add_argument("--depth-policy", default=EngineArgs.depth_policy, choices=DEPTH_POLICIES,
                        help="how deep the tokens of requests with a depth range run: fixed (the range's "
                             "maximum), slo (as deep as keeps each step within --tpot-slo-ms), confidence "
                             "(a sampled token stops at the first level whose readout is confident) or need "
                             "(slo with that exit, its cap priced knowing which tokens stop early)")
    parser.add_argument("--tpot-slo-ms", type=float, default=None,
                        help="the time per output token the slo depth policy keeps each step within")
    parser.add_argument("--confidence-threshold", type=float, default=None,
                        help="the top-1 probability at which a sampled token of a depth range stops deepening "
                             "(--depth-policy confidence, or slo to exit early within its cap)")
    parser.add_argument("--prompt-exit", action="store_true", default=EngineArgs.prompt_exit,
                        help="with --confidence-threshold: a prompt token of a depth range stops at the first level "
                             "whose readout gives the prompt's next token that probability (teacher-forced)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs) if hasattr(ns, f.name)})


def cmd_models(_: argparse.Namespace) -> int:
    for name, model in BUILTIN_MODELS.items():
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}\t{model.description}")
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from depthserve.depth import DepthParams
    from depthserve.errors import DepthServeError
    from depthserve.sampling_params import SamplingParams

    engine_args = engine_args_from(ns)
    try:  # a wrong name, path or option fails here, before torch is imported or anything loads
        resolve_model(ns.model, ns.revision)
        engine_args.validate()
    except DepthServeError as exc:
        return fail(str(exc))
    from depthserve.api import LLM

    try:
        llm = LLM(**vars(engine_args))
        params = SamplingParams(
            temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
            seed=ns.sampling_seed, stop=ns.stop or None,
        )
        depth = DepthParams.from_dict(ns.depth, known=knob_names()) if ns.depth is not None else None
        if ns.chat:
            prompt = llm.apply_chat_template([{"role": "user", "content": ns.prompt}])
        else:
            prompt = ns.prompt
        _stream_one(llm, prompt, params, depth)
    except DepthServeError as exc:
        return fail(str(exc))
    return 0


def _stream_one(llm, prompt, params, depth) -> None:
    """Print the text as the engine produces it, one step at a time; then, for a depth model, what
    the request spent on depth (on stderr, so stdout stays the text)."""
    engine = llm.engine
    engine.add_request("cli-0", prompt, params, depth)
    shown = 0
    last = None
    while engine.has_unfinished_requests():
        for last in engine.step():
            text = last.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    if last is not None and last.depth is not None:
        report = last.depth.to_dict()
        shown_keys = [k for k in report if k not in ("flops", "plain_flops", "architecture")]
        summary = ", ".join(f"{k}={_short(report[k])}" for k in shown_keys)
        print(f"depth ({report['architecture']}): {summary}", file=sys.stderr)


def _short(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else json.dumps(value, separators=(",", ":"))


def _depth_preset(text: str) -> tuple[str, dict]:
    name, sep, settings = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("a depth preset is NAME='{\"loops\": 2}'")
    try:
        value = json.loads(settings)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"depth preset {name!r} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"depth preset {name!r} must be a JSON object")
    return name, value


def cmd_serve(ns: argparse.Namespace) -> int:
    from depthserve.depth import DepthParams
    from depthserve.errors import DepthServeError

    presets = dict(ns.depth_preset or [])
    if ns.model_tag is not None:  # `serve MODEL`, as vLLM's
        if ns.model not in (DEFAULT_MODEL, ns.model_tag):
            return fail(f"two models: {ns.model_tag} and --model {ns.model}; name one")
        ns.model = ns.model_tag
    engine_args = engine_args_from(ns)
    try:  # what can be checked without the model, before torch is imported or the model loads
        resolve_model(ns.model, ns.revision)
        engine_args.validate()
        for name, settings in presets.items():
            DepthParams.from_dict(settings, known=knob_names())
    except DepthServeError as exc:
        return fail(str(exc))
    problem = _serve_option_problem(ns) or _listen_problem(ns.host, ns.port)
    if problem:
        return fail(problem)
    chat_template = None
    if ns.chat_template is not None:
        try:
            chat_template = Path(ns.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return fail(f"--chat-template: cannot read {ns.chat_template}: {exc}")
    max_body_bytes = int(ns.max_body_mb * (1 << 20))
    limits = connection_limits(ns)
    if ns.replicas is not None or ns.max_replicas is not None:
        return _serve_replicas(ns, engine_args, presets, max_body_bytes, chat_template, limits)
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.server.app import configure_logging, run_server

    configure_logging(ns.log_level)
    try:
        llm = AsyncLLM.from_engine_args(engine_args, ns.max_waiting_requests, presets)
    except DepthServeError as exc:
        return fail(str(exc))
    run_server(llm, ns.host, ns.port, ns.served_model_name, ns.api_key, presets, ns.log_level,
               max_body_bytes=max_body_bytes, chat_template=chat_template, limits=limits)
    return 0


DEFAULT_LIMITS = ConnectionLimits()


def connection_limits(ns: argparse.Namespace) -> ConnectionLimits:
    """The server's connection deadlines from `serve`'s flags (their defaults: ConnectionLimits')."""
    return ConnectionLimits(header_timeout_s=ns.header_timeout, body_timeout_s=ns.body_timeout,
                            keep_alive_s=ns.timeout_keep_alive)


def _serve_replicas(ns: argparse.Namespace, engine_args: EngineArgs, presets: dict[str, dict], max_body_bytes: int,
                    chat_template: str | None, limits: ConnectionLimits) -> int:
    """`serve --replicas N` (or `--max-replicas`): a local Ray cluster, N engine replicas, one endpoint."""
    from depthserve.errors import DepthServeError
    from depthserve.server.app import configure_logging

    try:
        from depthserve.deploy import ray_serve
    except ImportError as exc:  # pragma: no cover - depends on the install
        return fail(f"--replicas needs Ray Serve (pip install 'depthserve[ray]'): {exc}")
    configure_logging(ns.log_level)
    threads = engine_args.num_threads or 1
    settings = ray_serve.ReplicaSettings(engine_args, ns.served_model_name, ns.api_key, presets,
                                         ns.max_waiting_requests, max_body_bytes, chat_template)
    scaling = ray_serve.Scaling(replicas=ns.replicas or 1, max_replicas=ns.max_replicas, cpus_per_replica=threads,
                                routing=ns.routing)
    try:
        scaling.check()
        ray_serve.run(settings, scaling, ns.host, ns.port, num_cpus=ns.ray_cpus, log_level=ns.log_level,
                      limits=limits)
    except DepthServeError as exc:
        return fail(str(exc))
    return 0


def _serve_option_problem(ns: argparse.Namespace) -> str | None:
    """What is wrong with the server's own numeric options, if anything."""
    if not 1 <= ns.port <= 65535:
        return f"--port must be between 1 and 65535, got {ns.port}"
    if not ns.max_body_mb > 0:
        return f"--max-body-mb must be positive, got {ns.max_body_mb}"
    for flag, seconds in (("--header-timeout", ns.header_timeout), ("--body-timeout", ns.body_timeout),
                          ("--timeout-keep-alive", ns.timeout_keep_alive)):
        if not seconds > 0:
            return f"{flag} must be a positive number of seconds, got {seconds}"
    if ns.max_waiting_requests < 0:
        return f"--max-waiting-requests must be 0 or more, got {ns.max_waiting_requests}"
    if ns.replicas is not None and ns.replicas < 1:
        return f"--replicas must be at least 1, got {ns.replicas}"
    if ns.max_replicas is not None and ns.max_replicas < (ns.replicas or 1):
        return f"--max-replicas ({ns.max_replicas}) must be at least --replicas ({ns.replicas or 1})"
    return None


def _listen_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on (host, port), tried before the model loads: a host that
    is no address of this machine, or a port in use."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError):
        return f"--host {host!r} is not an address or a name that resolves"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use (choose another with --port)"
            return f"cannot listen on {host} port {port}: {exc.strerror or exc}"
    return None


CHAT_HELP = ('commands: /exit (or /bye, Ctrl-D) quit, /clear forget the conversation, """ starts and ends '
             "a multi-line message (also for a message that is one word starting with /); Ctrl-C stops a reply")


def cmd_chat(ns: argparse.Namespace) -> int:
    from depthserve.clients.client import DepthServeAPIError, DepthServeClient

    depth = ns.depth or {}
    try:
        client = DepthServeClient(ns.url, api_key=ns.api_key, model=ns.model)
        served = [model["id"] for model in client.models()]
    except Exception as exc:  # noqa: BLE001 - a CLI reports and exits
        return fail(f"cannot reach {ns.url}: {exc}")
    if ns.model is not None and ns.model not in served:
        return fail(f"{ns.url} serves no model {ns.model!r}; it serves {served}")
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    messages: list[dict[str, str]] = list(system)
    print(f"chatting with {client.model} at {ns.url}; {CHAT_HELP}")
    while True:
        try:
            line = _read_message()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit to quit)")
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/bye", "/quit"):
            return 0
        if command == "/clear":
            messages = list(system)
            print("(conversation cleared)")
            continue
        if command in ("/help", "/?"):
            print(CHAT_HELP)
            continue
        if command.startswith("/") and " " not in command:
            print(f"(unknown command {command}; {CHAT_HELP})")
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        stream = client.chat(messages, stream=True, max_tokens=ns.max_tokens, temperature=ns.temperature, **depth)
        try:
            for piece in stream:
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # stop this reply (closing the stream aborts it on the server)
            stream.close()
            print("\n(stopped)")
        except DepthServeAPIError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            messages.pop()
            continue
        else:
            print("\n(cut at --max-tokens)" if client.last_finish_reason == "length" else "")
        messages.append({"role": "assistant", "content": "".join(reply)})


def _read_message() -> str:
    """One message: a line, or the lines between two lines of \"\"\" (multi-line input)."""
    line = input("> ")
    if line.strip() != '"""':
        return line
    lines = []
    while (line := input(". ")).strip() != '"""':
        lines.append(line)
    return "\n".join(lines)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = CLIParser(prog="depthserve", description="Serve adaptive-depth transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, formatter_class=HelpFormatter)

    p_models = add("models", help="list the built-in model names")
    p_models.set_defaults(func=cmd_models)

    p_gen = add("generate", help="generate from a prompt, streaming to the terminal")
    add_engine_args(p_gen)
    p_gen.add_argument("prompt")
    p_gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p_gen.add_argument("--max-tokens", type=int, default=128)
    p_gen.add_argument("--temperature", type=float, default=0.0)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--top-k", type=int, default=0)
    p_gen.add_argument("--sampling-seed", type=int, default=None)
    p_gen.add_argument("--stop", action="append")
    p_gen.add_argument("--depth", type=_depth_json, default=None, help='depth settings as JSON, e.g. \'{"loops": 2}\'')
    p_gen.set_defaults(func=cmd_generate)

    p_serve = add("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p_serve)
    p_serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model takes it")
    p_serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p_serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    p_serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p_serve.add_argument("--served-model-name", default=None, help="model id in the API (default: --model)")
    p_serve.add_argument("--depth-preset", action="append", type=_depth_preset, metavar="NAME=JSON",
                         help="extra model id <model>:NAME with these depth settings (repeatable)")
    p_serve.add_argument("--max-waiting-requests", type=int, default=256,
                         help="requests that may wait beyond the --max-num-seqs running ones; beyond it: HTTP 503 "
                              "with Retry-After")
    p_serve.add_argument("--max-body-mb", type=float, default=4.0,
                         help="largest request body accepted; larger ones get HTTP 413")
    p_serve.add_argument("--header-timeout", type=float, default=DEFAULT_LIMITS.header_timeout_s, metavar="SECONDS",
                         help="a connection's time to send a complete request head, from opening or from its "
                              "previous response; then it is closed (slowloris)")
    p_serve.add_argument("--body-timeout", type=float, default=DEFAULT_LIMITS.body_timeout_s, metavar="SECONDS",
                         help="a request body's time to arrive in full after its head; then HTTP 408 and the "
                              "connection is closed")
    p_serve.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_LIMITS.keep_alive_s,
                         metavar="SECONDS", help="an idle keep-alive connection is closed after this long")
    p_serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                         help="debug adds /health and /metrics polls and ignored request fields")
    p_serve.add_argument("--chat-template", default=None, metavar="FILE",
                         help="a Jinja chat template replacing the model's (one that reads `tools` renders them "
                              "itself; otherwise the default tool template applies: docs/server.md)")
    p_serve.add_argument("--replicas", type=int, default=None,
                         help="serve through Ray Serve: this many engine replicas behind one endpoint on a local "
                              "Ray cluster, each with --num-threads threads (needs depthserve[ray]; docs/server.md, "
                              "Scaling out). Without it: one engine in this process")
    p_serve.add_argument("--max-replicas", type=int, default=None,
                         help="autoscale between --replicas and this many replicas on ongoing requests")
    p_serve.add_argument("--ray-cpus", type=int, default=None,
                         help="CPUs of the local Ray cluster (default: every CPU of the machine)")
    p_serve.add_argument("--routing", default="prefix", choices=["prefix", "least-loaded"],
                         help="how prompts are sent to replicas: to the replica that computed the longest run of their "
                              "leading blocks (prefix, the default), or to the replica with the fewest calls in flight")
    p_serve.set_defaults(func=cmd_serve)

    p_chat = add("chat", help="terminal chat with a running server (streams tokens)")
    p_chat.add_argument("--url", default="http://127.0.0.1:8000")
    p_chat.add_argument("--api-key", default=None)
    p_chat.add_argument("--model", default=None, help="model id (default: the server's first)")
    p_chat.add_argument("--system", default=None, help="system message")
    p_chat.add_argument("--max-tokens", type=int, default=256)
    p_chat.add_argument("--temperature", type=float, default=0.7)
    p_chat.add_argument("--depth", type=_depth_json, default=None, help='depth knobs as JSON, e.g. \'{"loops": 2}\'')
    p_chat.set_defaults(func=cmd_chat)

    for command in tool_commands():
        if command.name in (argv or ()):  # the tool asked for: its module defines its options
            importlib.import_module(command.module).add_subcommands(sub)
        else:  # listed in --help without importing its module (and torch with it)
            sub.add_parser(command.name, help=command.help)
    return parser


# The tools of every architecture: each module adds its own subcommand, imported only when that one runs.
GENERAL_TOOLS = (
    Command("make-tiny", "depthserve.lab.make_tiny",
            "write a small random checkpoint of any served architecture in the native format"),
    Command("train-demo", "depthserve.lab.demo.cli", "train a small depth model on variable chasing"),
)


def tool_commands() -> list[Command]:
    """The checkpoint tools: make-tiny and train-demo, then each registered architecture's own."""
    return [*GENERAL_TOOLS, *(command for architecture in architectures() for command in architecture.commands)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser(argv).parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
