"""The ``dpneuro`` command."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import time
from dataclasses import fields, replace
from numbers import Integral
from pathlib import Path

from dpneuro import __version__
from dpneuro.config import (
    DEFAULT_RUN_ID,
    Boolean,
    ConfigError,
    Interval,
    OrNone,
    RunConfig,
    SiteEntry,
    StrOptions,
    constraint,
    summary,
)
from dpneuro.config import SYNTHETIC_CONSORTIUM as SC
from dpneuro.config.constraints import Excluding
from dpneuro.data.images import SPACES
from dpneuro.datasets.synth import MODELS as SYNTH_MODELS
from dpneuro.datasets.synth import make_consortium
from dpneuro.deploy.sharedfs import aggregator_main, load_party_config, site_main
from dpneuro.privacy.summary import headline_lines, privacy_warnings
from dpneuro.protocol.exchange.keys import generate_key
from dpneuro.report.timings import lines as timing_lines
from dpneuro.run.features import features
from dpneuro.run.pipeline import Interrupted, prepare, progress
from dpneuro.run.planner import (
    MAPS_OVERLAP,
    buys_nothing,
    group_detectable,
    plan_for_target,
    site_shapes,
    spend,
    subjects_needed,
)

EXIT_OK = 0
EXIT_USAGE = 2


def _cmd_synth(args: argparse.Namespace) -> int:
    subjects = [int(s) for s in str(args.subjects).split(",")]
    per_site = subjects[0] if len(subjects) == 1 else subjects
    manifest = make_consortium(
        args.out,
        n_sites=args.sites,
        subjects_per_site=per_site,
        n_components=args.components,
        n_timepoints=args.timepoints,
        space=args.space,
        random_state=args.seed,
        progress=not args.quiet,
        dtype=args.dtype,
        states=args.brain_states,
        model=args.model,
        workers=args.workers,
        compress=not args.no_compress,
    )
    if not args.quiet:
        n_subj = sum(len(s["subjects"]) for s in manifest["sites"])
        print(f"wrote {len(manifest['sites'])} sites, {n_subj} subjects to {args.out}")
        print(f"manifest: {manifest['manifest_path']}")
    return EXIT_OK


def _demo_settings() -> dict:
    """The demo: the default synthetic consortium analysed with the recommended settings."""
    rec = RunConfig.recommended()
    # the number of components is the data's (the synthetic consortium has this many networks)
    return {**SC, **rec, "n_components": SC["components"], "clip": rec["clip_G"]}


#: the demo's consortium and budget (read by benchmarks/centralized_tools.py)
DEMO = _demo_settings()


def _demo_estimator(out: Path, manifest: dict, args: argparse.Namespace):
    """The demo's analysis: the library's defaults, with the synthetic consortium's number of networks."""
    from dpneuro.estimators import DecentralizedICA  # deferred: it loads scikit-learn, which only demo and run need

    return DecentralizedICA(n_components=DEMO["n_components"], mask=manifest["mask"], truth=str(out / "data"),
                            random_state=args.seed, out=out, run_id="run", engine="pydra-cf",
                            brain_states=args.brain_states, verbose=int(not args.quiet))


def _print_privacy(priv: dict, warnings: list[str] | None = None) -> None:
    """The privacy headline of a run (from privacy.json), its warnings (default: the privacy ones) to stderr."""
    for line in headline_lines(priv):
        print(line)
    for name, s in priv["sites"].items():
        print(f"  {name}: eps = {s['epsilon']:.2f} (exact GDP), {s['epsilon_rdp']:.2f} (RDP); "
              f"one site's releases alone: at most {s['epsilon_single_release']:.2f} (secondary)")
    for w in privacy_warnings(priv) if warnings is None else warnings:
        print(w, file=sys.stderr)


def _print_summary(out: Path, seconds: float, quiet: bool = False) -> None:
    """What a run wrote to ``out`` and what it cost, for the terminal, read from its files (its warnings reach
    the user even when ``quiet``)."""
    run = json.loads((out / "run.json").read_text())
    if quiet:
        for w in run.get("warnings", []):
            print(w, file=sys.stderr)
        return
    print(f"report:     {out / 'report.html'}")
    print(f"components: {out / 'components.nii.gz'}")
    print(f"privacy:    {out / 'privacy.json'}")
    if (out / "site_maps").is_dir():
        print(f"site maps:  {out / 'site_maps'} (each site's own, at voxel resolution)")
    if run.get("signal"):
        print(f"signal:     {run['signal']}")
    if run.get("metrics"):
        print("truth:      " + ", ".join(f"{k} = {v:.3f}" for k, v in run["metrics"].items()))
    _print_privacy(json.loads((out / "privacy.json").read_text()), run.get("warnings", []))
    print("stages:")  # the stages' times as the run recorded them (also in the report)
    for line in timing_lines(run.get("timings_s", {})):
        print(f"  {line}")
    print(f"wall time:  {seconds:.1f} s")


def _cmd_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = Path(args.out).resolve()
    d = DEMO
    if not args.quiet:
        print(f"synthesizing a {d['sites']}-site consortium ({d['subjects']} subjects per site, "
              f"{d['space']}) in {out / 'data'} ...")
    manifest = make_consortium(out / "data", n_sites=d["sites"], subjects_per_site=d["subjects"],
                               n_components=d["components"], n_timepoints=d["timepoints"], space=d["space"],
                               random_state=args.seed, progress=not args.quiet, dtype=d["dtype"],
                               states=args.brain_states)
    est = _demo_estimator(out, manifest, args)
    if not args.quiet:
        unmix = "capeDJICA" if est.ica == "temporal" else "spatial ICA of the released basis"
        later = "".join(f" -> {name}" for name, on in (("static FNC", est.fnc), ("brain states", args.brain_states))
                        if on)
        print(f"running the workflow (load -> capePCA -> {unmix}{later} -> maps -> report) ...")
    est.fit({s["site"]: s["path"] for s in manifest["sites"]})
    _print_summary(est.output_dir_, time.perf_counter() - t0, args.quiet)
    if not args.keep_work:
        shutil.rmtree(out / "work", ignore_errors=True)  # intermediate files: ~as large as the data
    if not args.quiet:
        print(f"disk:       {_du(out) / 2**20:.0f} MB in {out} (synthetic data {_du(out / 'data') / 2**20:.0f} MB)")
    return EXIT_OK


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _cmd_run(args: argparse.Namespace) -> int:
    from dpneuro.workflows import run_workflow  # deferred: it loads Pydra, which only this command needs

    t0 = time.perf_counter()
    cfg = RunConfig.read(args.config)
    if args.run_id is not None:
        cfg = replace(cfg, run_id=args.run_id)
    cfg, _ = prepare(cfg)  # validated once; a total epsilon planned from the sites' counts
    # SIGTERM ends the run as Ctrl-C does, through main's message (inside the workflow, which also stops its
    # workers: dpneuro.deploy.workflow.run_workflow), rather than at once
    before = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        run_workflow(cfg, plugin=args.plugin, prepared=True)
    finally:
        signal.signal(signal.SIGTERM, before)
    _print_summary(cfg.run_dir, time.perf_counter() - t0, args.quiet)
    return EXIT_OK


def _budget_overrides() -> dict[str, tuple[str, ...]]:
    """``dpneuro budget``'s overriding options (argparse dest) -> the fields each sets (the fields' ``flag``)."""
    out: dict[str, tuple[str, ...]] = {}
    for f in fields(RunConfig):
        if flag := f.metadata.get("flag"):
            out[flag.replace("-", "_")] = out.get(flag.replace("-", "_"), ()) + (f.name,)
    return out


def _add_overrides(group) -> None:
    """One option per ``flag`` of the fields: type, choices and help from the fields' descriptions."""
    for dest, names in _budget_overrides().items():
        c = constraint(names[0])
        while isinstance(c, (OrNone, Excluding)):  # the type is the wrapped constraint's
            c = c.inner
        kw: dict = {}
        if isinstance(c, StrOptions):
            kw["choices"] = c.options
        elif isinstance(c, Boolean):
            kw["choices"] = ["on", "off"]
        elif isinstance(c, Interval):
            kw["type"] = int if c.kind is Integral else float
        group.add_argument("--" + dest.replace("_", "-"), default=None, **kw,
                           help=" ".join(f"field {name}: {summary(name)}" for name in names))


def _counts(text: str) -> int | list[int]:
    """``--subjects`` / ``--timepoints``: one whole number, or a comma list of them (one per site)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number or a comma list of them") from None
    return values[0] if len(values) == 1 else values


def _budget_config(args: argparse.Namespace):
    """The configuration to plan: a run.toml, or the defaults with ``--sites`` placeholder sites."""
    if args.config:
        if args.sites is not None:
            raise ConfigError("give either a run configuration or --sites, not both")
        cfg = RunConfig.read(args.config)
    else:
        n_sites = len(args.subjects) if args.sites is None and isinstance(args.subjects, list) else args.sites
        if n_sites is None or args.subjects is None:
            raise ConfigError("give a run configuration (dpneuro budget run.toml) or --sites and --subjects")
        cfg = RunConfig(sites=[SiteEntry(f"site-{i + 1:02d}", "") for i in range(max(n_sites, 0))], out="")
    changes = {}
    for opt, names in _budget_overrides().items():
        v = getattr(args, opt)
        if v in ("on", "off"):  # a boolean field's option
            v = v == "on"
        if v is not None:
            changes.update(dict.fromkeys(names, v))
    return replace(cfg, **changes).validate(data_sites=())


def _cmd_budget(args: argparse.Namespace) -> int:
    cfg = _budget_config(args)
    shapes = site_shapes(cfg, subjects=args.subjects, timepoints=args.timepoints)
    dim = features(cfg, args.features)
    # a total epsilon in the configuration is planned as the run plans it (budget.apply_target)
    target = args.target_epsilon if args.target_epsilon is not None else cfg.epsilon
    needed = for_maps = None
    if target is not None:
        plan = plan_for_target(replace(cfg, epsilon=None), shapes, dim, target, pca_share=args.pca_share)
        # equal sites of the median subject's length: what a consortium of this kind needs at this budget
        volumes = int(statistics.median(n for s in shapes for n in s.lengths))
        needed = subjects_needed(replace(cfg, epsilon=None), dim, target, timepoints=volumes)
        for_maps = subjects_needed(replace(cfg, epsilon=None), dim, target, timepoints=volumes, criterion="maps")
    else:
        plan = spend(cfg, shapes, dim)
    if args.json:
        print(json.dumps({**plan.to_dict(), "subjects_needed": needed, "subjects_for_maps": for_maps}, indent=1,
                         default=str))
        return EXIT_OK
    print(plan)
    if target is not None and not cfg.allow_noise_maps and (why := buys_nothing(plan)):
        print(f"STOP: a run of this plan stops before its first release: {why}")
    if target is not None:
        print(f"Subjects per site this budget needs for all {cfg.n_components} components above the noise: "
              + (f"{needed} ({len(shapes)} equal sites of {volumes} volumes per subject; region-level fMRI's "
                 "reference spectrum)" if needed else "the reference spectrum of region-level fMRI does not apply "
                 f"to D = {dim} features (it covers 50 to 400)"))
        if for_maps:
            print(f"Subjects per site for maps that agree with the non-private ones at about 0.8 (component "
                  f"{cfg.n_components}'s eigenvector at squared overlap >= {MAPS_OVERLAP:g}; calibrated on real "
                  f"fMRI): {for_maps}")
    if args.effect is not None:
        if not cfg.design:
            raise ConfigError("--effect needs a design (design and covariates in the configuration)")
        for row in group_detectable(plan.config, [len(s.lengths) for s in shapes], effect=args.effect):
            n = row["subjects_for_effect"]
            print(f"Subjects per site to find {args.effect:g} with 80 % power, {row['contrast']}, {row['family']}: "
                  + (f"about {n}" if n else "more than 100 times these sites") + " (this split of the budget)")
    return EXIT_OK


def _cmd_site(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cfg = load_party_config(args.config, site=args.site)
    res = site_main(cfg, args.site, run_id=args.run_id, key_file=args.key_file, keys_file=args.keys,
                    progress=not args.quiet)
    if not args.quiet:
        print(f"site {args.site}: done in {time.perf_counter() - t0:.1f} s")
        print(f"components:  {res['components']}")
        print(f"time courses: {res['timecourses']} (stay at this site)")
        print(f"privacy:     {res['privacy']} (eps = {res['epsilon']:.2f} against the aggregator and its "
              f"colluders, exact GDP, delta = {cfg.delta:g})")
    return EXIT_OK


def _cmd_aggregator(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cfg = load_party_config(args.config)
    res = aggregator_main(cfg, run_id=args.run_id, key_file=args.key_file, keys_file=args.keys,
                          progress=not args.quiet)
    if not args.quiet:
        print(f"aggregator: done in {time.perf_counter() - t0:.1f} s; {res['ica_rounds']} ICA rounds "
              f"({res['ica_status']})")
        print(f"report:     {res['report']}")
        print(f"components: {res['components']}")
        print(f"signal:     {res['signal']}")
        print(f"privacy:    {res['privacy']}")
        _print_privacy(json.loads(Path(res["privacy"]).read_text()), res.get("warnings"))
    return EXIT_OK


def _cmd_keygen(args: argparse.Namespace) -> int:
    public = generate_key(args.key_file)
    # stdout is the keys-file line alone, so `dpneuro keygen ... >> consortium.keys` makes a valid keys file
    print(f"private key: {args.key_file} (0600: keep it on this machine)", file=sys.stderr)
    print("public key, for the consortium's keys file (every party gets the same file, passed with --keys), "
          "on stdout:", file=sys.stderr)
    print(f"{json.dumps(args.party)} = \"{public}\"")
    return EXIT_OK


def _add_party_parsers(sub) -> None:
    """``dpneuro site`` and ``dpneuro aggregator``: one role of a run each, over a shared folder."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("config", help="run configuration (see site_templates/run.toml and site.toml)")
    common.add_argument("--run-id", default=None,
                        help=f"field run_id: {summary('run_id')} Default: the configuration's, {DEFAULT_RUN_ID!r} "
                             "unless set")
    common.add_argument("--key-file", default=None,
                        help="this party's private signing key (from `dpneuro keygen`); it never leaves this "
                             "machine")
    common.add_argument("--keys", default=None,
                        help="the consortium's keys file: every party's public key, pinned out of band "
                             "(required unless the configuration sets simulation = true)")
    common.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    s = sub.add_parser("site", parents=[common],
                       help="run one site's part of a consortium run over the shared folder exchange_dir",
                       description="One site of a deployed run: reads only this site's data, checks its settings "
                                   "against the aggregator's run manifest in exchange_dir, and sends only noised "
                                   "or masked arrays. Its maps, time courses and privacy.json go to "
                                   "<out>/<run-id>/<site>/.")
    s.add_argument("--site", required=True, help="this site's name (as listed in the config's sites)")
    s.set_defaults(func=_cmd_site)
    s = sub.add_parser("keygen", help="make a party's signing key and print its public key",
                       description="Makes this party's private Ed25519 key (0600, never overwritten) and prints "
                                   "the line for the consortium's keys file on stdout (what it did on stderr), so "
                                   "`dpneuro keygen NAME.key --party NAME >> consortium.keys` adds it to a keys "
                                   "file. Every party (the aggregator and each site) runs it once; the consortium "
                                   "collects the lines into one file and checks each by a channel it trusts (e.g. "
                                   "read out on a call).")
    s.add_argument("key_file", help="where to write the private key")
    s.add_argument("--party", required=True, help="the party's name in the run: a site's name, or 'aggregator'")
    s.set_defaults(func=_cmd_keygen, quiet=True)
    s = sub.add_parser("aggregator", parents=[common],
                       help="run the aggregator of a consortium run over the shared folder exchange_dir",
                       description="The aggregator of a deployed run: writes the run manifest (the settings every "
                                   "site must share) into exchange_dir, combines the sites' signed "
                                   "releases, and writes the maps, privacy.json and report.html to "
                                   "<out>/<run-id>/. It holds no data.")
    s.set_defaults(func=_cmd_aggregator)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpneuro",
        description="Differentially private decentralized fMRI analysis (CAPE).",
    )
    p.add_argument("--version", action="version", version=f"dpneuro {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("synth", help="write a synthetic multi-site fMRI consortium (ground truth known)",
                       description="Defaults: the consortium the demo and site_templates/run.toml are tuned for.")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--sites", type=int, default=SC["sites"], help=f"number of sites (default {SC['sites']})")
    s.add_argument(
        "--subjects", default=str(SC["subjects"]),
        help=f"subjects per site: one number, or a comma list with one entry per site (default {SC['subjects']})",
    )
    s.add_argument("--components", type=int, default=SC["components"],
                   help=f"number of spatial maps (default {SC['components']})")
    s.add_argument("--timepoints", type=int, default=SC["timepoints"],
                   help=f"volumes per subject (default {SC['timepoints']})")
    s.add_argument("--space", default=SC["space"], choices=SPACES,
                   help=f"voxel grid and mask (default {SC['space']})")
    s.add_argument("--dtype", default=SC["dtype"], choices=["int16", "float32"],
                   help=f"storage of the BOLD images: int16 with a scale factor (half the disk) or float32 "
                        f"(default {SC['dtype']})")
    s.add_argument("--seed", type=int, default=0, help="seed of everything generated (default 0)")
    s.add_argument("--brain-states", type=int, default=0, metavar="K",
                   help="plant K dFNC connectivity states in the sources (0: none, the default); the planted "
                        "matrices and each subject's state at every volume go in the truth for the report to "
                        "compare with")
    s.add_argument("--model", default="blobs", choices=SYNTH_MODELS,
                   help="blobs: 1-3 smooth blobs per map, independent heavy-tailed sources (the papers' model, the "
                        "default); networks: distributed, bilateral, overlapping networks with slow, correlated, "
                        "near-Gaussian time courses, global signal and structured noise (looks like real fMRI)")
    s.add_argument("--workers", type=int, default=None, metavar="N",
                   help="subjects written at once (default: the usable CPU cores; 1: one at a time); the output "
                        "is the same for any N")
    s.add_argument("--no-compress", action="store_true",
                   help="write the BOLD images as uncompressed .nii (faster, ~4.5x the disk at int16) instead of "
                        ".nii.gz")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    s.set_defaults(func=_cmd_synth)

    s = sub.add_parser("demo", help="synthesize a 4-site consortium and run the whole private analysis on it",
                       description="Writes the default synthetic consortium (dpneuro synth's) into <out>/data and "
                                   "analyses it with the library's default settings, every site simulated on this "
                                   "machine; prints where the report, maps and privacy.json are and what each "
                                   "site spent.")
    s.add_argument("--out", default="dpneuro_demo",
                   help="output folder, relative to the current folder (default ./dpneuro_demo)")
    s.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the noise (default 0)")
    s.add_argument("--keep-work", action="store_true",
                   help="keep the intermediate files (run/work: data matrices, Pydra cache)")
    s.add_argument("--brain-states", type=int, default=0, metavar="K",
                   help="plant K dFNC connectivity states in the synthetic sources and find them privately "
                        "(brain_states = K; 0: off, the default)")
    s.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    s.set_defaults(func=_cmd_demo)

    s = sub.add_parser("run", help="run a consortium analysis described by a TOML config",
                       description="Simulates a whole consortium run on this machine (every site's data must be "
                                   "readable here) through the Pydra workflow: the settings are those of the "
                                   "configuration (site_templates/run.toml explains each), the outputs go to "
                                   "<out>/<run_id>/. Deployed runs use `dpneuro site` and `dpneuro aggregator`.")
    s.add_argument("config", help="run configuration (see site_templates/run.toml)")
    s.add_argument("--run-id", default=None,
                   help=f"field run_id: {summary('run_id')} Default: the configuration's, {DEFAULT_RUN_ID!r} "
                        "unless set; the cache of stages (<out>/work) is shared")
    s.add_argument("--plugin", default="cf", choices=["serial", "cf"],
                   help="Pydra execution plugin: cf (the default: concurrent workers, one per usable core, so the "
                        "sites load at the same time) or serial (one stage at a time; each site still decodes its "
                        "subjects in parallel threads)")
    s.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser(
        "budget", help="what a configuration spends per site, or the settings that spend a target epsilon",
        description="Plans from the same release list the run records, so the prediction is what the run's "
                    "privacy.json will show (for a run that uses all its ICA rounds). The headline is eps "
                    "against the aggregator colluding with the assumed number of sites.")
    s.add_argument("config", nargs="?", default=None,
                   help="run configuration (run.toml); subject counts are read from the sites' file headers")
    s.add_argument("--sites", type=int, default=None,
                   help="without a configuration: number of sites (default: one per --subjects entry)")
    s.add_argument("--subjects", type=_counts, default=None,
                   help="subjects per site instead of reading the data (required without a configuration): one "
                        "number for every site, or one per site in the sites' order (30,60,90,120)")
    s.add_argument("--timepoints", type=_counts, default=None,
                   help="volumes per subject with --subjects (default 150): one number, or one per site")
    s.add_argument("--features", type=int, default=None,
                   help="features D after reduction, for the noise estimate (default: from mask/space/parcels)")
    s.add_argument("--target-epsilon", type=float, default=None,
                   help="propose pca_epsilon, ica_epsilon_i (and states_epsilon) so that the largest per-site "
                        "eps is this")
    s.add_argument("--pca-share", type=float, default=None,
                   help="with --target-epsilon: share of mu^2 (GDP) given to the reduction (default: the split of "
                        "the configuration's settings, the tuned one unless changed)")
    _add_overrides(s.add_argument_group("overrides of configuration fields (default: the configuration's value)"))
    s.add_argument("--effect", type=float, default=None,
                   help="with a design: the effect (per unit of each contrast, e.g. 0.3 Fisher z for a group's FNC "
                        "difference) the study must find with 80 %% power; prints the subjects per site it needs")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.set_defaults(func=_cmd_budget)

    _add_party_parsers(sub)
    return p


def _interrupted_message(command: str, exc: KeyboardInterrupt) -> str:
    """One line: which signal stopped what, and for `dpneuro run` that the same command resumes."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    line = f"dpneuro {command}: interrupted by {signal.Signals(signum).name}"
    if getattr(exc, "stage", ""):
        line += f" while {exc.stage}"
    if command == "run":
        line += "; workers stopped, finished stages kept: run the same command again to resume"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        with progress(not getattr(args, "quiet", True)):
            return int(args.func(args))
    except (ValueError, FileNotFoundError, RuntimeError, PermissionError) as exc:
        print(f"dpneuro {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a full disk, a read-only folder: the file and the reason, not a traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"dpneuro {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM too while `dpneuro run` works (pipeline.Interrupted)
        print(_interrupted_message(args.command, exc), file=sys.stderr)
        return exc.exit_code if isinstance(exc, Interrupted) else 128 + signal.SIGINT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
