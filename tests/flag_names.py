"""`python tests/flag_names.py COMMAND`: the names of every flag `COMMAND`.py takes (its own,
the shared ones and absl's), one a line. test_docs runs it through tests/command_server.py."""

import importlib
import sys

from absl import flags

importlib.import_module(f'transformer_jax.commands.{sys.argv[1]}')
print('\n'.join(flags.FLAGS))
