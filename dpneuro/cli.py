"""The ``dpneuro`` command."""

from __future__ import annotations

import argparse
import sys

from . import __version__

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAILED = 1


def _cmd_synth(args: argparse.Namespace) -> int:
    from .synth import make_consortium

    subjects = [int(s) for s in str(args.subjects).split(",")]
    per_site = subjects[0] if len(subjects) == 1 else subjects
    manifest = make_consortium(
        args.out,
        n_sites=args.sites,
        subjects_per_site=per_site,
        n_components=args.components,
        n_timepoints=args.timepoints,
        space=args.space,
        seed=args.seed,
        progress=not args.quiet,
    )
    if not args.quiet:
        n_subj = sum(len(s["subjects"]) for s in manifest["sites"])
        print(f"wrote {len(manifest['sites'])} sites, {n_subj} subjects to {args.out}")
        print(f"manifest: {manifest['manifest_path']}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpneuro",
        description="Differentially private decentralized fMRI analysis (CAPE).",
    )
    p.add_argument("--version", action="version", version=f"dpneuro {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("synth", help="write a synthetic multi-site fMRI consortium (ground truth known)")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--sites", type=int, default=4, help="number of sites (default 4)")
    s.add_argument(
        "--subjects", default="16",
        help="subjects per site: one number, or a comma list with one entry per site (default 16)",
    )
    s.add_argument("--components", type=int, default=20, help="number of spatial maps (default 20)")
    s.add_argument("--timepoints", type=int, default=150, help="volumes per subject (default 150)")
    s.add_argument("--space", default="mni4mm", choices=["mni4mm", "mni6mm", "grid30"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=_cmd_synth)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"dpneuro {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
