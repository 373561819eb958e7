"""The benchmark suite: `python -m bench [--quick] [--only NAME ...]`.

Runs every benchmark module in one process tree, one after another (never two
at once: they would measure each other), and rewrites BENCHMARKS.md with the
tables from this run, the command that produced them and the machine details.
Every comparison inside a module runs both sides in the same run, alternating.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCHMARKS, machine, machine_line, write_section

# In the order of BENCHMARKS.md; each module has run(quick), markdown(result), SECTION.
MODULES = (
    "warm",
    "service",
    "serving",
    "first_answer",
    "field",
    "hidden_model",
    "size_limit",
    "lifecycle",
    "sync_process",
    "server",
    "nginx",
    "hostile",
    "signatures",
    "fleet",
    "fleet_start",
    "lease_scale",
    "manifest",
    "wire",
    "seam",
    "oci",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the short suite (under 10 minutes on 2 cores)"
    )
    parser.add_argument("--only", nargs="+", choices=MODULES, help="run only these benchmarks")
    parser.add_argument(
        "--no-write", action="store_true", help="print results, leave BENCHMARKS.md alone"
    )
    parser.add_argument(
        "--json", dest="json_out", metavar="FILE", help="also write all results to FILE"
    )
    args = parser.parse_args(argv)
    names = args.only or list(MODULES)
    info = machine()
    print(machine_line(info), file=sys.stderr)
    results: dict[str, object] = {"machine": info, "quick": args.quick}
    failed = []
    sections: dict[str, str] = {}
    started = time.monotonic()
    modules = [importlib.import_module(f"bench.{name}") for name in names]
    for name, module in zip(names, modules, strict=True):
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            result = module.run(quick=args.quick)
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
            continue
        results[name] = result
        print(f"bench: {name} done in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        sections[module.SECTION] = module.markdown(result)
        if not args.no_write:
            write_section(
                module.SECTION, sections[module.SECTION]
            )  # kept even if a later part fails
    total = time.monotonic() - started
    if not args.no_write:
        command = "python -m bench" + (" --quick" if args.quick else "")
        header = (
            "## How these numbers were made\n\n"
            f"`{command}` ({total / 60:.1f} minutes). {machine_line(info)} These machines are shared and "
            "noisy: each table quotes medians with min–max and the ratio of two sides measured in the same "
            "run, alternating; compare ratios, not absolute times.\n"
        )
        if not args.only and not failed:
            # A whole run: rewrite the file in the suite's order, from this run alone.
            body = (
                "# Benchmarks\n\n" + header + "\n" + "\n".join(sections[m.SECTION] for m in modules)
            )
            BENCHMARKS.write_text(body)
        # With --only, each section already names its command and machine load: the header,
        # which describes a whole run, is left as it is.
        print(f"bench: wrote {BENCHMARKS}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str))
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
