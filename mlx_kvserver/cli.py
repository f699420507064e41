"""``mlx-kvserver`` / ``python -m mlx_kvserver``: serve one or more models over HTTP (its flags:
``flags.py``; the start: ``server.py``)."""

from __future__ import annotations

import logging
import os

from .flags import config_from_args, parse_args

log = logging.getLogger("mlx_kvserver")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if os.environ.get("MLX_KVSERVER_NO_BLAS") is None and args.no_fast_blas:
        os.environ["MLX_KVSERVER_NO_BLAS"] = "1"
    from .platform import blas
    blas.maybe_reexec()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    from .server import load_server

    log.info("BLAS: %s", blas.blas_status())
    load_server(config).run(args.log_level)


if __name__ == "__main__":
    main()
