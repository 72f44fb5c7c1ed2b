"""``kvpool-layout``: a model's KV layout, ready to paste into a ``MooncakeKVPool`` consumer.

It computes the layout the way a vLLM server with the same flags builds it (see
:mod:`kvpool.connector.local.layout_probe`: vLLM's own model classes on the
``meta`` device, its own attention backends and KV-cache grouping; no weights,
no KV cache) from the model's config and the flags that shape the layout: tensor
and pipeline parallel sizes, block size, KV-cache dtype, model dtype. Run it with
the same vLLM, on the same kind of machine, as the servers (e.g. in the vLLM
image): the attention backend decides block sizes and page sizes.

It prints the consumer's ``layout:`` block (YAML, or JSON with ``--format json``)
with its fingerprint, the value ``status.consumers[].layoutFingerprint`` will show.

Exit status: 0 with the layout; 1 when it cannot be computed, or the connector cannot
serve it; 2 for a bad argument, a ``--block-size`` vLLM's attention backends on this
platform do not run included (its workers refuse it too); 128 + the signal's number
after SIGINT or SIGTERM, which stop the ranks (a SIGKILL takes them with it: each rank has a
watchdog). The ranks' temporary files (vLLM's IPC sockets) go in a folder of their own,
removed when they stop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvpool.connector.contract.layout import KVLayout, check, fingerprint
from kvpool.connector.local.stopping import Stopped, raise_on_stop_signals


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-layout",
        description="Print the KV layout vLLM builds for a model, as the `layout:` block of a "
        "MooncakeKVPool consumer. Needs vLLM; loads no weights.",
    )
    parser.add_argument("--model", required=True, help="model name or path, exactly as vLLM's --model")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="vLLM's -tp (default 1)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="vLLM's -pp (default 1)")
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype (the KV dtype when auto)")
    parser.add_argument("--max-model-len", type=int, default=None, help="vLLM's --max-model-len")
    parser.add_argument("--revision", default=None, help="vLLM's --revision")
    parser.add_argument("--trust-remote-code", action="store_true", help="vLLM's --trust-remote-code")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other vLLM engine argument (EngineArgs field name; VALUE as JSON, else a string), "
        "e.g. mamba_cache_mode=align; repeatable",
    )
    parser.add_argument(
        "--model-id", default="", help="the connector's model_id setting, when the servers set one"
    )
    parser.add_argument("--format", choices=("yaml", "json"), default="yaml")
    return parser


def engine_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """vLLM ``EngineArgs`` fields from the command line; a bad ``--engine-arg`` stops it."""
    out: dict[str, Any] = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "dtype": args.dtype,
        "trust_remote_code": args.trust_remote_code,
    }
    for name, value in (
        ("block_size", args.block_size),
        ("max_model_len", args.max_model_len),
        ("revision", args.revision),
    ):
        if value is not None:
            out[name] = value
    own_options = set(out) | {"block_size", "max_model_len", "revision"}
    for item in args.engine_arg:
        name, eq, raw = item.partition("=")
        if not eq or not name.isidentifier():
            parser.error(f"--engine-arg {item!r}: use NAME=VALUE with an EngineArgs field name")
        if name in own_options:
            parser.error(f"--engine-arg {name}: use --{name.replace('_', '-')} (an option of its own)")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    for option, size in (("--tensor-parallel-size", args.tensor_parallel_size),
                         ("--pipeline-parallel-size", args.pipeline_parallel_size),
                         ("--block-size", args.block_size),
                         ("--max-model-len", args.max_model_len)):  # fmt: skip
        if size is not None and size < 1:
            parser.error(f"{option}: at least 1")
    return out


def render(layout: KVLayout, form: str = "yaml") -> str:
    """The ``layout:`` block (YAML) or the layout object (JSON), defaults left out."""
    body = layout.model_dump(mode="json", exclude_defaults=True)
    if form == "json":
        return json.dumps(body, indent=2)
    try:
        import yaml
    except ImportError:  # JSON is YAML too
        return f"layout: {json.dumps(body)}"
    text = yaml.safe_dump({"layout": body}, sort_keys=False, default_flow_style=False)
    return text.rstrip("\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    wanted = engine_args(args, parser)
    # Standard output carries the layout block alone: vLLM logs to standard error.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with raise_on_stop_signals():  # the probe stops its ranks and removes their files
        try:
            try:
                from kvpool.connector.local.layout_probe import (
                    ProbeError,
                    UnsupportedBlockSize,
                    engine_arg_names,
                    probe_layout,
                )
            except ImportError as exc:
                print(
                    f"kvpool-layout needs vLLM installed (the same vLLM as the servers): {exc}",
                    file=sys.stderr,
                )
                return 2
            unknown = sorted(set(wanted) - engine_arg_names())
            if unknown:
                parser.error(f"--engine-arg {unknown[0]}: not a field of vLLM's EngineArgs")
            try:
                layout = probe_layout(wanted, args.model_id)
            except UnsupportedBlockSize as exc:
                # vLLM's workers refuse it too: no server with these flags would start.
                parser.print_usage(sys.stderr)
                rule = "a size vLLM's attention backends on this platform run"
                print(f"kvpool-layout: error: --block-size: {rule}: {exc}", file=sys.stderr)
                return 2
            except (ProbeError, ValueError, TypeError, OSError) as exc:
                print(f"kvpool-layout: {exc}", file=sys.stderr)
                return 1
        except Stopped as stopped:
            print(f"kvpool-layout: stopped by {stopped}", file=sys.stderr)
            return stopped.exit_status
    problems = check(layout)
    note = f"# fingerprint {fingerprint(layout)}; paste under the consumer in the MooncakeKVPool spec"
    # JSON has no comments: the note goes to standard error there.
    print(note, file=sys.stdout if args.format == "yaml" else sys.stderr)
    print(render(layout, args.format))
    for problem in problems:
        print(f"kvpool-layout: the connector cannot serve this layout: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
