"""The ``hybridrt`` command line (typer): ``chat``, ``generate``, ``bench``.

The app lives in ``hybridrt.cli.main``; it is not imported here so that importing the package
stays cheap.
"""
