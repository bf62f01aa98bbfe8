"""``python -m mlx_dflash`` and the ``mlx-dflash`` command."""


def main() -> None:
    """The command line; a Ctrl-C while its modules load (mlx-lm and
    transformers take a second or two) exits 130 quietly, as one during a
    command does."""
    from .blas import release_sigint

    try:
        release_sigint()  # held across a re-run under OpenBLAS, so its start cannot be cut
        from .cli import main as cli_main
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    cli_main()


if __name__ == "__main__":
    main()
