"""Depth-elastic serving: the depth policies against `fixed` under rising load, in one run.

    python bench/depth_elastic.py --model DIR --tpot-slo-ms 60            # a Dreamer checkpoint
    python bench/depth_elastic.py --model demo-dreamer --demo-task --policies fixed,slo,slo+confidence,need
    python bench/depth_elastic.py --quick          # demo-dreamer on demo-task prompts: needs no data set

One server of the same checkpoint is launched per policy of `--policies` (`fixed`: `depthserve serve
--depth-policy fixed`; `slo`: `--depth-policy slo --tpot-slo-ms T`; `slo+confidence`: that with
`--confidence-threshold P`; `need`: `--depth-policy need --tpot-slo-ms T --confidence-threshold P`;
`confidence`: `--depth-policy confidence --confidence-threshold P`); at each request rate the same
streamed workload (bench/serving.py: C4 prompts of `--input-len` tokens, `--output-len` greedy
tokens, Poisson arrivals) goes to each server in turn, so machine drift hits all alike. Every
request asks for a depth range (`--depth`, default `{"depth": "auto"}`: the model's whole range),
which `fixed` runs at its maximum and the others lower as their policy says. Per rate and policy:
the serving summary (TTFT, TPOT, goodput with the SLO TPOT <= T), the mean depth of every token the
requests computed (usage.depth.mean_depth, prompts included) and of the output tokens (the streamed
token_depths). The result names the rate `fixed` sustains within T (at least 90% of its requests
within T at that rate and every lower one: SLO attainment, DistServe's measure of capacity; the
rate up to which its p99 TPOT stays within T is given too) and compares every policy with it at
twice that rate when it was run.
Result: bench/results/depth-elastic-<label>.json; chart by bench/plot.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import serving  # noqa: E402

POLICIES = ("fixed", "slo", "slo+confidence", "need", "confidence")
QUICK_MODEL = "demo-dreamer"  # built in: a smoke run needs neither a checkpoint nor ../shared/data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=False, default=None, help="a checkpoint with an elastic depth knob (Dreamer)")
    p.add_argument("--tpot-slo-ms", type=float, default=60.0, help="the TPOT target (slo policy and goodput)")
    p.add_argument("--policies", default="fixed,slo",
                   help=f"comma-separated, `fixed` first: the baseline (of {', '.join(POLICIES)})")
    p.add_argument("--confidence-threshold", type=float, default=0.99,
                   help="the exit's top-1 probability, for slo+confidence, need and confidence")
    p.add_argument("--request-rate", default="2,4,6,8,10,12", help="requests/s, comma-separated")
    p.add_argument("--num-prompts", type=int, default=192, help="requests per rate and policy")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--depth", default='{"depth": "auto"}', help="the depth range every request asks for (JSON)")
    p.add_argument("--dataset", type=Path, default=common.C4_SAMPLE)
    p.add_argument("--threads", type=int, default=2, help="the servers' torch threads")
    p.add_argument("--dtype", default="auto", help="the servers' --dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="cpu-2core")
    p.add_argument("--demo-task", action="store_true",
                   help="prompts are held-out problems of the demo task (depthserve/demo/task.py, for a demo "
                        "model such as demo-dreamer): each answer is checked, giving the accuracy of what each "
                        "policy served")
    p.add_argument("--quick", action="store_true",
                   help="8 prompts, rates 4 and 8; without --model, demo-dreamer on held-out demo problems (the "
                        "package's own prompts: no data set needed)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.num_prompts, ns.input_len, ns.output_len, ns.request_rate = 8, 32, 8, "4,8"
        if ns.model is None:
            ns.model, ns.demo_task = QUICK_MODEL, True
    if ns.model is None and not ns.quick:
        p.error("--model is required (or --quick)")
    ns.policy_list = ns.policies.split(",")
    if ns.policy_list[0] != "fixed" or any(policy not in POLICIES for policy in ns.policy_list):
        p.error(f"--policies: `fixed` first, then any of {', '.join(POLICIES[1:])}")
    return ns


def policy_server_args(policy: str, ns: argparse.Namespace) -> str:
    """The `depthserve serve` options of one policy of the run."""
    slo, exit_ = f" --tpot-slo-ms {ns.tpot_slo_ms:g}", f" --confidence-threshold {ns.confidence_threshold:g}"
    flags = {"fixed": "--depth-policy fixed", "slo": "--depth-policy slo" + slo,
             "slo+confidence": "--depth-policy slo" + slo + exit_, "need": "--depth-policy need" + slo + exit_,
             "confidence": "--depth-policy confidence" + exit_}[policy]
    dtype = "" if ns.dtype == "auto" else f" --dtype {ns.dtype}"
    return f"--num-threads {ns.threads}{dtype} {flags}"


def serving_namespace(ns: argparse.Namespace) -> argparse.Namespace:
    """The settings bench/serving.py's run functions read."""
    import json

    return argparse.Namespace(arrival="poisson", seed=ns.seed, max_concurrency=None, no_progress=True,
                              percentiles="50,90,99", slos_ms={"tpot": ns.tpot_slo_ms}, depth_knobs=json.loads(ns.depth))


async def run(urls: dict[str, str], ns: argparse.Namespace) -> dict[str, Any]:
    sns = serving_namespace(ns)
    rates = common.parse_number_list(ns.request_rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = {policy: httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits)
               for policy, url in urls.items()}
    async with contextlib.AsyncExitStack() as stack:
        for client in clients.values():
            await stack.enter_async_context(client)
        first = clients["fixed"]
        model_id = (await first.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        answers = None
        if ns.demo_task:
            prompts, answers = await demo_task_prompts(first, ns)
        else:
            prompts = await serving.dataset_prompts(first, ns.dataset, ns.num_prompts, ns.input_len)
        bodies = [serving.completion_body(model_id, p, ns.output_len, sns.depth_knobs) for p in prompts]
        for client in clients.values():  # one warm-up request each
            warm = await serving.send_streaming_request(client, bodies[0], time.perf_counter())
            if not warm.ok:
                raise SystemExit(f"the warm-up request failed: {warm.error}")
        runs = []
        for rate in rates:
            row: dict[str, Any] = {"request_rate": rate}
            for policy, client in clients.items():
                await serving.reset_prefix_cache(client)
                results, duration = await serving.run_at_rate(client, bodies, rate, sns)
                summary = serving.summarize_run(results, duration, sns)
                outputs = [d for r in results if r.ok for d in r.token_depths]
                summary["mean_output_depth"] = sum(outputs) / len(outputs) if outputs else None
                line = f"{policy:>14} {serving.format_summary(rate, summary)} | output depth {summary['mean_output_depth'] or 0:.2f}"
                if answers is not None:
                    right = [r.ok and r.text.split()[:1] == [a] for r, a in zip(results, answers)]
                    summary["accuracy"] = sum(right) / len(right)
                    line += f" | accuracy {summary['accuracy']:.3f}"
                row[policy] = {"summary": summary, "requests": [compact(r.as_dict(), keep_text=ns.demo_task)
                                                                for r in results]}
                print(line, flush=True)
            runs.append(row)
    return {"model_id": model_id, "runs": runs}


def compact(request: dict[str, Any], keep_text: bool) -> dict[str, Any]:
    """A request's record as the result keeps it: times to 10 us, no inter-token gaps (TPOT and the
    depth of every token stay), the text only where answers are graded."""
    out = {key: round(value, 5) if isinstance(value, float) else value
           for key, value in request.items() if key not in ("itl_s", "text")}
    if keep_text:
        out["text"] = request["text"]
    return out


async def demo_task_prompts(client: httpx.AsyncClient, ns: argparse.Namespace) -> tuple[list[list[int]], list[str]]:
    """Held-out demo problems (hops up to 6, seed --seed) as token ids, and their answers."""
    from depthserve.demo.task import problems

    held_out = problems(ns.seed, ns.num_prompts, "held_out", 6)
    prompts = []
    for problem in held_out:
        reply = await client.post("/tokenize", json={"prompt": problem.prompt, "add_special_tokens": False})
        prompts.append(reply.raise_for_status().json()["tokens"])
    return prompts, [problem.answer for problem in held_out]


ATTAINMENT = 0.9  # the share of requests within the TPOT target at which a server sustains a rate (DistServe's)


def attainment(row: dict, policy: str) -> float:
    summary = row[policy]["summary"]
    return summary["good_requests"] / max(1, summary["completed"] + summary["failed"])


def sustained_rate(runs: list[dict[str, Any]], meets) -> float | None:
    """The largest request rate up to which every rate run meets `meets(row)` (None: not the lowest)."""
    best = None
    for row in sorted(runs, key=lambda row: row["request_rate"]):
        if not meets(row):
            break
        best = row["request_rate"]
    return best


def at_rate(runs: list[dict[str, Any]], rate: float | None) -> dict[str, Any] | None:
    """Every policy's figures at `rate`, if it was run, and each one's goodput over fixed's
    (`goodput_ratio`: slo's, where slo ran)."""
    row = next((row for row in runs if rate is not None and row["request_rate"] == rate), None)
    if row is None:
        return None
    out: dict[str, Any] = {"request_rate": rate}
    policies = [policy for policy in row if policy != "request_rate"]
    for policy in policies:
        summary = row[policy]["summary"]
        out[policy] = {"p99_tpot_ms": summary["tpot_ms"]["p99"], "goodput": summary["goodput"],
                       "slo_attainment": attainment(row, policy), "mean_depth": summary.get("mean_depth"),
                       "mean_output_depth": summary.get("mean_output_depth"), "accuracy": summary.get("accuracy")}
    fixed_goodput = out["fixed"]["goodput"]
    out["goodput_over_fixed"] = {policy: out[policy]["goodput"] / fixed_goodput if fixed_goodput else None
                                 for policy in policies if policy != "fixed"}
    out["goodput_ratio"] = out["goodput_over_fixed"].get("slo")
    return out


def comparison(runs: list[dict[str, Any]], target_ms: float) -> dict[str, Any]:
    """The rate `fixed` sustains within the TPOT target, and both policies at twice that rate.
    Sustained: up to that rate, at least ATTAINMENT of fixed's requests met the target at every rate
    run (SLO attainment, as DistServe defines a system's capacity); also given by p99 TPOT within the
    target at every rate (the stricter reading, noisier at a few hundred requests)."""
    by_attainment = sustained_rate(runs, lambda row: attainment(row, "fixed") >= ATTAINMENT)
    by_p99 = sustained_rate(runs, lambda row: row["fixed"]["summary"]["tpot_ms"]["p99"] <= target_ms)
    return {
        "tpot_slo_ms": target_ms,
        "attainment": ATTAINMENT,
        "fixed_sustained_rate": by_attainment,
        "fixed_sustained_rate_by_p99": by_p99,
        "at_twice_the_rate": at_rate(runs, None if by_attainment is None else 2 * by_attainment),
        "at_twice_the_rate_by_p99": at_rate(runs, None if by_p99 is None else 2 * by_p99),
    }


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if not ns.demo_task and not ns.dataset.exists():
        print(f"skipping the depth-elastic benchmark: the prompt data set {ns.dataset} is absent")
        return 0
    server_args = {policy: policy_server_args(policy, ns) for policy in ns.policy_list}
    with contextlib.ExitStack() as stack:
        urls = {policy: stack.enter_context(serving.launched_server(ns.model, args, 600.0))
                for policy, args in server_args.items()}
        outcome = asyncio.run(run(urls, ns))
    payload = {
        "benchmark": "depth-elastic",
        "description": "streamed completions asking for a depth range, the depth policies taking turns at each "
                       "request rate",
        "settings": {**{k: v for k, v in vars(ns).items() if k not in ("dataset", "policy_list")},
                     "dataset": str(ns.dataset),
                     "server_args": server_args},
        "model_id": outcome["model_id"],
        "comparison": comparison(outcome["runs"], ns.tpot_slo_ms),
        "runs": outcome["runs"],
        "environment": common.environment("cpu", ns.threads),
    }
    label = f"{ns.label}{common.QUICK_SUFFIX}" if ns.quick else ns.label
    print(f"wrote {common.write_result(f'depth-elastic-{label}', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
