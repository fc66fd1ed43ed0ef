import argparse

from wakegate.extproc.main import add_arguments, main

_parser = argparse.ArgumentParser(prog="wakegate extproc")
add_arguments(_parser)
raise SystemExit(main(_parser.parse_args()))
