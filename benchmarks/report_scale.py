"""Report scale: render the candidate report for 10,000 synthetic prompts; print seconds and MB.

Builds a golden and a candidate run in the real storage format (tests/report_fixtures.py:
every class present, 128-token outputs, top-5 logprobs, a prompt set with plain and chat
prompts), scores them with the real scorer (bag-of-words stand-in for the semantic model),
then times ``write_candidate_report`` (index.html, junit.xml, summary.md, metrics.json) on
runs already loaded, as the CLI holds them after scoring. With --browser, also opens the page
in headless Chromium and times load, filtering, sorting and opening a prompt.

Usage: python benchmarks/report_scale.py [--prompts 10000] [--tokens 128] [--browser]
Writes benchmarks/results/report_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from report_fixtures import build_case  # noqa: E402

from regress.report import write_candidate_report  # noqa: E402

BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"]


def browser_timings(page_path: Path) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1366, "height": 768})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        t0 = time.perf_counter()
        page.goto(page_path.as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        out["load_s"] = round(time.perf_counter() - t0, 2)

        def timed(label: str, action) -> None:
            t = time.perf_counter()
            action()
            page.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
            out[label] = round(time.perf_counter() - t, 3)

        timed("filter_class_s", lambda: page.click("#class-filter .chip[data-class='drift']"))
        timed("sort_metric_s", lambda: page.click("#prompt-head th[data-key='m:tf_kl_mean']"))
        timed("search_s", lambda: (page.fill("#search", "harbour"), page.wait_for_timeout(200)))
        timed("open_detail_s", lambda: page.click("#prompt-rows tr"))
        out["console_errors"] = len(errors)
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--browser", action="store_true", help="also time the page in headless Chromium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        case = build_case(root, args.prompts, tokens=args.tokens)
        build_s = time.perf_counter() - t0
        out = root / "reports" / "candidate"
        t0 = time.perf_counter()
        page = write_candidate_report(case.score, case.golden, case.run, case.prompt_set, out)
        render_s = time.perf_counter() - t0
        sizes = {f.name: f.stat().st_size for f in out.iterdir()}
        result = {
            "prompts": args.prompts, "tokens": args.tokens, "top_k": 5, "cpu_count": os.cpu_count(),
            "classes": {k: getattr(case.score.metrics, k) for k in ("identical", "benign", "drift", "regression",
                                                                     "input_drift")},
            "build_and_score_s": round(build_s, 2),
            "render_s": round(render_s, 2),
            "index_html_mb": round(sizes["index.html"] / 1e6, 2),
            "junit_xml_mb": round(sizes["junit.xml"] / 1e6, 2),
            "summary_md_kb": round(sizes["summary.md"] / 1e3, 1),
        }
        print(f"rendered {args.prompts:,} prompts in {render_s:.2f} s; index.html {sizes['index.html'] / 1e6:.2f} MB",
              flush=True)
        if args.browser:
            result["chromium"] = browser_timings(page)
            print("chromium", result["chromium"], flush=True)
    dest = REPO / "benchmarks" / "results" / "report_scale.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
