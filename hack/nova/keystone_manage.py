"""Run several keystone-manage commands in one Python process.

    python keystone_manage.py CONFIG_FILE COMMAND [ARGS...] [-- COMMAND ...]

Each command goes through keystone-manage's own entry point
(keystone.cmd.cli.main) exactly as `keystone-manage --config-file CONFIG_FILE
COMMAND ARGS` would run it. The only difference is that Keystone is imported
once: on two cores each separate keystone-manage spends ~4 s of CPU importing
before it does ~0.3 s of work, and hack/nova.sh's start-up waits on these
commands (db_sync, fernet_setup, credential_setup, bootstrap).
"""

import sys
import time


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    config_file, rest = argv[1], argv[2:]
    commands, current = [], []
    for arg in rest:
        if arg == '--':
            commands.append(current)
            current = []
        else:
            current.append(arg)
    commands.append(current)

    t0 = time.monotonic()
    from keystone.cmd import cli
    from keystone.conf import CONF
    for command in commands:
        # cli.main registers its sub-command option and parses the command
        # line; clear() undoes the previous parse so that it can.
        CONF.clear()
        cli.main(argv=['keystone-manage', '--config-file', config_file]
                 + command)
        print('keystone_manage: %s done (%.1f s)'
              % (command[0], time.monotonic() - t0), file=sys.stderr,
              flush=True)


if __name__ == '__main__':
    main(sys.argv)
