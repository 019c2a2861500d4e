"""The `foresight` command: serve, bench, eval-quality, prepare-model, train, eval-drafter, eval-foresight."""
from __future__ import annotations

import argparse
import sys

# Imported in the functions: `serve` takes the stop signals over before torch and the models load.


def build_parser() -> argparse.ArgumentParser:
    from .config import add_engine_args, add_server_args
    from .training.cli import add_train_args

    parser = argparse.ArgumentParser(prog="foresight", description="LLM serving with pipelined speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible server (api + target and drafter workers)")
    add_engine_args(serve)
    add_server_args(serve)

    bench = sub.add_parser("bench", help="run every mode on the same prompts and write a JSON report")
    add_engine_args(bench)
    from .bench.harness import add_bench_args

    add_bench_args(bench)

    # "resolve": eval-quality's --verification (a list of settings) and --mode replace the engine flags.
    quality = sub.add_parser("eval-quality", conflict_handler="resolve",
                             help="HumanEval pass@1, speed and target NLL per verification rule, in one run")
    add_engine_args(quality)
    from .bench.quality import add_quality_args

    add_quality_args(quality)

    sub.add_parser("prepare-model", help="convert the embedded default model into its cache folder")
    add_train_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    early = None
    if argv[:1] == ["serve"]:
        from .server.shutdown import EarlyStop

        early = EarlyStop().install()  # SIGTERM while loading: exit 0, not death by the signal (143)
    return _main(argv, early)


def _main(argv: list[str], early=None) -> int:
    from .config import ConfigError, engine_from_args
    from .training.cli import COMMANDS as TRAIN_COMMANDS, run as run_training

    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare-model":
            from .models.loading import prepare_default_model

            print(prepare_default_model())
            return 0
        if args.command in TRAIN_COMMANDS:
            return run_training(args)
        engine = engine_from_args(args)
        check_split(engine)
        if args.command == "serve":
            return serve(args, engine, early)
        if args.command == "eval-quality":
            check_mode(engine)
            from .bench.quality import run_quality

            return run_quality(args, engine)
        from .bench.harness import run_bench

        return run_bench(args, engine)
    except ConfigError as exc:
        print(f"foresight: error: {exc}", file=sys.stderr)
        return 2


def check_mode(engine) -> None:
    """`--mode pipelined` needs a foresight drafter, `--mode hybrid` a draft model: say so before any model is
    loaded (the workers would only find out at start-up, inside the server's lifespan, as a traceback)."""
    from .config import ConfigError
    from .drafter_worker.jetspec_proposer import resolve_drafter_path
    from .drafter_worker.worker import why_no_foresight
    from .protocol.kinds import Mode

    if engine.mode == Mode.HYBRID and resolve_drafter_path(engine) is None:
        raise ConfigError(f"--mode hybrid needs a trained drafter (--drafter {engine.drafter} means prompt lookup "
                          f"alone here); use --mode ngram, sync or ar")
    if engine.mode != Mode.PIPELINED:
        return
    why = why_no_foresight(engine)
    if why is not None:
        raise ConfigError(f"--mode pipelined needs a drafter with foresight (a trained drafter and its adapter): "
                          f"{why}; use --mode sync or ar")


def check_split(engine) -> None:
    """A tensor-parallel split that cannot share out the target's heads: said before any worker starts."""
    if engine.tensor_parallel_size > 1:
        from .models.loading import resolve_target
        from .target_worker.tensor_parallel import check_divides

        check_divides(engine.tensor_parallel_size, resolve_target(engine.target))


# After the drain, open connections get this long to close before uvicorn cancels them.
CONNECTION_CLOSE_S = 5.0


def serve(args: argparse.Namespace, engine, early=None) -> int:
    """Serve until SIGTERM/SIGINT (then drain) or until the engine gives up; 0 after a clean drain,
    1 when a worker's restart budget was spent."""
    from .config import server_from_args

    cfg = server_from_args(args, engine)
    check_mode(engine)
    import logging

    import uvicorn

    from .protocol.leftovers import remove_own_folders
    from .placement import pin_api
    from .server.app import create_app
    from .server.connections import header_timeout_protocol
    from .server.shutdown import DrainingServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if early is not None:
        early.defer()  # from here on a stop signal has a socket folder and workers to clean up
    pin_api(engine)  # the workers it spawns start there too, then pin themselves to their own cores
    app = create_app(cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info",
                            timeout_graceful_shutdown=CONNECTION_CLOSE_S,
                            http=header_timeout_protocol(cfg.header_timeout_s), limit_concurrency=cfg.max_connections)
    server = DrainingServer(config, app.state.drain, early)
    server.run()
    if server.force_exit:
        remove_own_folders()  # the engine's own clean-up was skipped; the workers follow their parent out
    return app.state.drain.exit_code


if __name__ == "__main__":
    sys.exit(main())
