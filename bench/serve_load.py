"""Load test for `mlx-dflash serve`: N chat requests at concurrency C over loopback.

Each of the C clients holds a conversation, as a chat app or coding agent does:
turn k resends the whole history (its prompt, the model's replies, a new user
line), so the prefix cache can serve everything but the new turn. Records per
request the time to first token (first content delta) and total latency, and
overall completion tokens/s and the prefix-cache hit rate, to
bench/results/serve-load.{md,json}.

    python bench/serve_load.py                      # starts a server on the embedded pair
    python bench/serve_load.py --url http://127.0.0.1:8080 --model-name my-model -n 64 -c 8

Bounded: at most -n requests, none started after --time-limit seconds, loopback only.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dflash.blas import openblas_path  # noqa: E402


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _metrics(url, headers):
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, prompt_cache: bool = True):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "mlx_dflash",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-queue",
        str(max(64, args.concurrency)),
    ] + ([] if prompt_cache else ["--no-prompt-cache"])
    if args.model:
        cmd += ["--model", args.model]
    if args.draft:
        cmd += ["--draft", args.draft]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    lib = openblas_path()  # timings on Linux are taken with OpenBLAS (see mlx_dflash/blas.py)
    if lib:
        env["LD_PRELOAD"] = lib
    args.blas = f"server with OpenBLAS preloaded ({lib})" if lib else "server on the bundled BLAS"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise SystemExit("server did not come up in 180 s")


def one_request(url, headers, model, messages, max_tokens):
    """Stream one chat completion; returns (ttft, latency, text, usage)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    tic = time.perf_counter()
    ttft, text, usage = None, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = ch["delta"].get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - tic
                    text.append(piece)
    return ttft, time.perf_counter() - tic, "".join(text), usage


def run_once(args, prompt_cache: bool):
    """One load run (a fresh server unless --url); returns (summary, per-request rows, errors)."""
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args, prompt_cache)
    headers = {"x-api-key": args.api_key} if args.api_key else {}
    prompts = sorted((ROOT / "mlx_dflash" / "bench_prompts").glob("*.txt"))
    try:
        # warm-up: first-call compilation and allocation are not what we measure
        one_request(url, headers, args.model_name, [{"role": "user", "content": "x = 1\n"}], 4)
        before = _metrics(url, headers)
        results, errors, lock = [], [], threading.Lock()
        counter = iter(range(args.requests))
        start = time.perf_counter()

        def client(c):
            # one conversation per client: the history grows by each reply and a new user line
            messages = [{"role": "user", "content": prompts[c % len(prompts)].read_text()}]
            while True:
                with lock:
                    i = next(counter, None)
                if i is None or time.perf_counter() - start > args.time_limit:
                    return
                try:
                    ttft, lat, text, usage = one_request(url, headers, args.model_name, messages, args.max_tokens)
                except Exception as e:  # recorded, the run goes on
                    with lock:
                        errors.append(str(e))
                    return
                with lock:
                    results.append(
                        {
                            "client": c,
                            "turn": len(messages) // 2,
                            "ttft": ttft,
                            "latency": lat,
                            "prompt_tokens": usage["prompt_tokens"],
                            "completion_tokens": usage["completion_tokens"],
                            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                        }
                    )
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"\n# step {len(messages) // 2}\n"},
                ]

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        after = _metrics(url, headers)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)

    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    lats = [r["latency"] for r in results]
    gen = sum(r["completion_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    later = [r for r in results if r["turn"] > 0]  # turns that resend a history
    d_cycles = after["mlx_dflash_decode_cycles_total"] - before["mlx_dflash_decode_cycles_total"]
    summary = {
        "prompt_cache": prompt_cache if not args.url else "as the server runs",
        "requests": len(results),
        "errors": len(errors),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "latency_p50_s": _pct(lats, 50),
        "latency_p95_s": _pct(lats, 95),
        "completion_tokens": gen,
        "tokens_per_s": gen / wall if wall else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_rate_tokens": cached / prompt if prompt else 0.0,
        "prefix_hit_rate_requests": (sum(r["cached_tokens"] > 0 for r in later) / len(later)) if later else 0.0,
        "cycles": d_cycles,
        # tokens committed by verify cycles (each request's first token comes from prefill)
        "tau": (
            after["mlx_dflash_generation_tokens_total"] - before["mlx_dflash_generation_tokens_total"] - len(results)
        )
        / d_cycles
        if d_cycles
        else 0.0,
    }
    return summary, results, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="A running server (loopback only). Default: start one here.")
    ap.add_argument("--model-name", default="mlx-dflash", help="Model id to send (default: the embedded pair's).")
    ap.add_argument("--model", help="--model for the server this script starts.")
    ap.add_argument("--draft", help="--draft for the server this script starts.")
    ap.add_argument("--api-key", help="Key for a server started with --api-key.")
    ap.add_argument("-n", "--requests", type=int, default=24, help="Total requests (default 24).")
    ap.add_argument("-c", "--concurrency", type=int, default=4, help="Concurrent clients (default 4).")
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens per request (default 48).")
    ap.add_argument("--time-limit", type=float, default=600, help="Start no request after this many seconds.")
    ap.add_argument(
        "--compare-no-cache",
        action="store_true",
        help="Also run the same load on a server started with --no-prompt-cache.",
    )
    ap.add_argument(
        "--out",
        default=str(ROOT / "bench" / "results" / "serve-load"),
        help="Output path without extension (.md and .json are written).",
    )
    args = ap.parse_args()
    if not 1 <= args.concurrency <= args.requests <= 10_000:
        raise SystemExit("need 1 <= concurrency <= requests <= 10000")
    if args.url and urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("--url must be a loopback address")
    if args.url and args.compare_no_cache:
        raise SystemExit("--compare-no-cache starts its own servers; drop --url")

    runs = [run_once(args, True)]
    if args.compare_no_cache:
        runs.append(run_once(args, False))
    where = args.url or f"a server started here on {args.model or 'the embedded pair'}"
    blas = getattr(args, "blas", "BLAS of the running server not known")
    cmd = f"python bench/serve_load.py -n {args.requests} -c {args.concurrency} --max-tokens {args.max_tokens}" + (
        " --compare-no-cache" if args.compare_no_cache else ""
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": cmd,
                "server": where,
                "blas": blas,
                "runs": [{"summary": s, "requests": r, "errors": e} for s, r, e in runs],
            },
            indent=2,
        )
    )
    md = [
        "# serve load",
        "",
        f"`{cmd}` against {where}; {blas}.",
        f"{args.concurrency} clients at once, each a conversation that resends its history every turn "
        "(its prompt, the replies, a new user line); greedy; streamed; TTFT includes the wait in the queue.",
        "",
        "| prefix cache | requests | errors | wall s | TTFT p50 s | TTFT p95 s | latency p50 s | latency p95 s |"
        " tok/s | prompt tokens | cached tokens | hit rate (tokens) | later turns with a hit | tau |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, _, _ in runs:
        md.append(
            f"| {'on' if s['prompt_cache'] is True else 'off' if s['prompt_cache'] is False else s['prompt_cache']} "
            f"| {s['requests']} | {s['errors']} | {s['wall_s']:.1f} | {s['ttft_p50_s']:.3f} | {s['ttft_p95_s']:.3f} | "
            f"{s['latency_p50_s']:.2f} | {s['latency_p95_s']:.2f} | {s['tokens_per_s']:.1f} | "
            f"{s['prompt_tokens']} | {s['cached_tokens']} | {s['prefix_hit_rate_tokens']:.1%} | "
            f"{s['prefix_hit_rate_requests']:.0%} | {s['tau']:.2f} |"
        )
    md.append("")
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    for _s, _, e in runs:
        if e:
            print(f"{len(e)} errors, first: {e[0]}", file=sys.stderr)


if __name__ == "__main__":
    main()
