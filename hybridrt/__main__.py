"""``python -m hybridrt ...`` behaves as the ``hybridrt`` console script."""

from hybridrt.cli.main import main

main()
