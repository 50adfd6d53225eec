"""The server backend's client overhead: regress's client against a bare aiohttp client.

One vLLM OpenAI-compatible server (the current environment's vLLM, started once, the fixture
model unless --model, the test suite's engine settings: bf16, eager, max_model_len 4096) gets
the same 128 streamed completion requests (prompt token ids, greedy, max_tokens, logprobs,
return_tokens_as_token_ids: the payloads regress's backend builds) from two clients, alternated
several times in one run, concurrency 16 for both:

- regress: ``VllmServerBackend.generate`` (asyncio + aiohttp, one session, a semaphore; parses
  every chunk's token ids and top-k logprobs into LogprobRows, records TTFT and latency);
- bare: an aiohttp session and a semaphore that send the same payloads streamed and
  ``json.loads`` every chunk, nothing else.

Prints each round's wall times, the medians and their ratio (goal: regress / bare <= 1.05), and
writes benchmarks/results/server_client_overhead.json.

Usage: python benchmarks/server_client_overhead.py [--requests 128] [--concurrency 16]
       [--rounds 6] [--max-tokens 48] [--logprobs 5] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from regress.backends.base import GenerationRequest  # noqa: E402
from regress.backends.server_process import (  # noqa: E402
    ServerProcess,
    free_port,
    server_command,
    server_environment,
)
from regress.backends.vllm_server import ENDPOINT, VllmServerBackend  # noqa: E402

ENGINE = {"dtype": "bfloat16", "engine_args": {"enforce_eager": True, "max_model_len": 4096}}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def bare_client(url: str, payloads: list[dict], concurrency: int) -> float:
    import aiohttp

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            gate = asyncio.Semaphore(concurrency)

            async def one(payload: dict) -> int:
                chunks = 0
                async with gate, session.post(url + ENDPOINT, json=payload) as response:
                    assert response.status == 200, await response.text()
                    async for raw in response.content:
                        line = raw.strip()
                        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                            json.loads(line[5:])
                            chunks += 1
                return chunks

            await asyncio.gather(*(one(p) for p in payloads))

    started = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "server_client_overhead.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="server-overhead-"))
    model = args.model
    if model is None:
        from regress.fixture_model import build_fixture_model

        model = work / "fixture"
        build_fixture_model(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = {"name": "bench", "backend": "server", "model": str(model.resolve()), **ENGINE,
            "server": {"url": url, "concurrency": args.concurrency}}
    log = (work / "server.log").open("w")
    started = time.perf_counter()
    server = ServerProcess(server_command(spec, port), server_environment({**os.environ, **ENV}), sink=log)
    try:
        server.wait_healthy(url, 600)
        start_s = time.perf_counter() - started
        backend = VllmServerBackend(spec)
        backend.load()
        sampling = dict(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens, min_tokens=0, seed=0,
                        stop=[], logprobs=args.logprobs, repetition_penalty=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, ignore_eos=True)
        texts = [f"Prompt {i}: the weather in city number {i} is" for i in range(args.requests)]
        requests = [GenerationRequest(backend.render({"prompt": t}), sampling) for t in texts]
        payloads = [backend._payload(r) for r in requests]

        cpu: dict[str, list[float]] = {"regress": [], "bare": []}

        def ours() -> float:
            t0, c0 = time.perf_counter(), time.process_time()
            outputs = backend.generate(requests, lambda n: None)
            assert all(len(o.output_token_ids) == args.max_tokens for o in outputs)
            cpu["regress"].append(time.process_time() - c0)
            return time.perf_counter() - t0

        def bare() -> float:
            c0 = time.process_time()
            wall = bare_client(url, payloads, args.concurrency)
            cpu["bare"].append(time.process_time() - c0)
            return wall

        bare_client(url, payloads[: args.concurrency], args.concurrency)  # warm-up
        rounds = []
        for i in range(args.rounds):
            # Alternate which goes first, so neither always follows the other.
            if i % 2 == 0:
                r, b = ours(), bare()
            else:
                b, r = bare(), ours()
            rounds.append({"regress_s": round(r, 3), "bare_s": round(b, 3), "ratio": round(r / b, 3),
                           "regress_client_cpu_s": round(cpu["regress"][-1], 3),
                           "bare_client_cpu_s": round(cpu["bare"][-1], 3)})
            print(f"round {i + 1}: regress {r:.2f} s, bare {b:.2f} s, ratio {r / b:.3f} "
                  f"(client CPU: regress {cpu['regress'][-1]:.2f} s, bare {cpu['bare'][-1]:.2f} s)", flush=True)
    finally:
        server.stop()
    med_r = statistics.median(x["regress_s"] for x in rounds)
    med_b = statistics.median(x["bare_s"] for x in rounds)
    result = {
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "logprobs": args.logprobs, "model": str(model), "server_start_s": round(start_s, 1),
        "rounds": rounds, "median_regress_s": med_r, "median_bare_s": med_b, "ratio": round(med_r / med_b, 3),
        "median_ratio_of_rounds": statistics.median(x["ratio"] for x in rounds),
        "goal": "ratio <= 1.05", "cpus": os.cpu_count(), "python": platform.python_version(),
        "load_average_at_end": list(os.getloadavg()),
    }
    print(f"median: regress {med_r:.2f} s, bare {med_b:.2f} s, ratio {med_r / med_b:.3f} (goal <= 1.05)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
