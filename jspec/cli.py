"""Command line: `jspec convert | inspect | make-random` (engine commands join as they land)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_convert(args) -> int:
    from jspec.convert import convert_checkpoint

    meta = convert_checkpoint(args.hf, args.out, dtype=args.dtype, progress=not args.quiet)
    print(f"wrote {meta['num_tensors']} tensors ({meta['dtype']}) to {args.out}")
    return 0


def _cmd_inspect(args) -> int:
    from jspec.convert import inspect_checkpoint

    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{'architecture':<14} {info['architecture']} ({info['format']}, {info['dtype']})")
    print(f"{'layers':<14} {info['num_layers']}  pattern {info['layer_pattern']}"
          "  (A attention, G Gated DeltaNet; lower case: MoE MLP)")
    print(f"{'hidden / vocab':<14} {info['hidden_size']} / {info['vocab_size']}")
    print(f"{'parameters':<14} {info['num_parameters']:,} in {info['num_tensors']} tensors")
    print(f"{'bytes':<14} {info['bytes']:,} ({info['bytes'] / 2**20:.1f} MiB)")
    if info["mtp_layers"]:
        print(f"{'mtp layers':<14} {info['mtp_layers']}")
    return 0


def _cmd_make_random(args) -> int:
    from jspec.models.presets import write_random_checkpoint

    write_random_checkpoint(args.out, args.preset, seed=args.seed, dtype=args.dtype)
    print(f"wrote random {args.preset} checkpoint to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jspec.models.presets import PRESETS

    p = argparse.ArgumentParser(prog="jspec", description="Speculative-decoding inference engine in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF safetensors checkpoint to orbax")
    c.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=_cmd_convert)

    i = sub.add_parser("inspect", help="print architecture, layer pattern, parameter count and bytes")
    i.add_argument("path", help="HF or orbax checkpoint directory")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    r = sub.add_parser("make-random", help="write an HF-format checkpoint with random weights")
    r.add_argument("--preset", default="tiny-qwen3", choices=sorted(PRESETS))
    r.add_argument("--out", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    r.set_defaults(func=_cmd_make_random)
    return p


def main(argv=None) -> int:
    from jspec.errors import JspecError
    from checkpoints.errors import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (JspecError, CheckpointError) as e:
        print(f"jspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
