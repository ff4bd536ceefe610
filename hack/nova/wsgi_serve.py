"""Serve one WSGI application on 127.0.0.1 with cheroot.

    python wsgi_serve.py NAME MODULE:ATTRIBUTE PORT [THREADS]

Used by hack/nova.sh for Keystone (keystone.wsgi.api:application) and
Placement (placement.wsgi.api:application): their own WSGI entry points, the
ones a real deployment hands to uwsgi or mod_wsgi. Only loopback is bound.

WSGI_SERVE_PRELOAD=MODULE imports MODULE first, and WSGI_SERVE_WAIT_FOR=
PATH[:PATH...] then waits (up to 120 s) until those files exist before the
entry point is imported: Keystone's entry point refuses to start without its
key repositories, but the expensive part, importing Keystone, can overlap
with the keystone-manage run that makes them.
Both keep their data in sqlite, where two threads that read and then write
in the same transaction fail at once with "database is locked" (the busy
handler cannot help a reader that wants to become a writer): concurrent
password logins, which update local_user, did so under the test suite.
Every transaction therefore starts with BEGIN IMMEDIATE, which takes the
write lock up front and waits for it (busy_timeout, 30 s): SQLAlchemy's
documented recipe for pysqlite.
SIGTERM/SIGINT stop the server; the process then exits at once, without
waiting for library threads (oslo timers, keystonemiddleware caches) that
would otherwise keep it alive.
"""

import importlib
import os
import signal
import sys
import threading
import time

from cheroot import wsgi

BIND_HOST = '127.0.0.1'
SQLITE_BUSY_TIMEOUT_MS = 30000


def serialize_sqlite_transactions():
    """Make every sqlite transaction of this process BEGIN IMMEDIATE.

    Listens on the Engine class, so it covers the engines oslo.db creates
    later. Other databases are left alone.
    """
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def is_sqlite(dbapi_connection):
        return type(dbapi_connection).__module__.startswith('sqlite3')

    @event.listens_for(Engine, 'connect')
    def on_connect(dbapi_connection, _record):
        if is_sqlite(dbapi_connection):
            # pysqlite's own implicit BEGIN is deferred; take over (as
            # oslo.db does too).
            dbapi_connection.isolation_level = None
            dbapi_connection.execute(
                'PRAGMA busy_timeout = %d' % SQLITE_BUSY_TIMEOUT_MS)

    @event.listens_for(Engine, 'begin')
    def on_begin(connection):
        # oslo.db emits a deferred BEGIN unless its marker says a
        # transaction is open; class listeners run before its engine ones.
        if (connection.dialect.name == 'sqlite'
                and 'in_transaction' not in connection.info):
            connection.exec_driver_sql('BEGIN IMMEDIATE')
            connection.info['in_transaction'] = True


def serve(name, app, port, threads=8):
    """Serve app on 127.0.0.1:port until SIGTERM or SIGINT; then exit.

    The server runs in a daemon thread and the main thread only waits for a
    signal: cheroot's stop() called from a signal handler that interrupted
    serve() on the same thread never returns. Stopping is bounded (3 s);
    the process exits right after.
    """
    server = wsgi.Server((BIND_HOST, port), app, numthreads=threads,
                         server_name=name, timeout=30, shutdown_timeout=2)
    stopping = threading.Event()

    def on_signal(signum, _frame):
        print('%s: signal %d, stopping' % (name, signum), file=sys.stderr,
              flush=True)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.prepare()
    print('%s: listening on http://%s:%d/ (pid %d)'
          % (name, BIND_HOST, server.bind_addr[1], os.getpid()),
          file=sys.stderr, flush=True)
    serving = threading.Thread(target=server.serve, name='http',
                               daemon=True)
    serving.start()
    while not stopping.wait(1) and serving.is_alive():
        pass
    rc = 0 if stopping.is_set() else 1
    stopper = threading.Thread(target=server.stop, daemon=True)
    stopper.start()
    stopper.join(3)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(rc)


def main(argv):
    if len(argv) not in (4, 5):
        sys.exit(__doc__)
    name, target, port = argv[1], argv[2], int(argv[3])
    threads = int(argv[4]) if len(argv) == 5 else 8
    module_name, attribute = target.split(':')
    # The entry points read sys.argv as their command line (oslo.config).
    sys.argv = [name]
    serialize_sqlite_transactions()
    if os.environ.get('WSGI_SERVE_PRELOAD'):
        importlib.import_module(os.environ['WSGI_SERVE_PRELOAD'])
    wait_for = [p for p in os.environ.get('WSGI_SERVE_WAIT_FOR', '').split(':')
                if p]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(p) for p in wait_for):
        if time.monotonic() > deadline:
            raise SystemExit('%s: still missing after 120 s: %s'
                             % (name, wait_for))
        time.sleep(0.1)
    app = getattr(importlib.import_module(module_name), attribute)
    serve(name, app, port, threads)


if __name__ == '__main__':
    try:
        main(sys.argv)
    except BaseException as e:
        # E.g. the port is taken: exit even if the application started
        # threads of its own that would keep the process alive.
        print('%s: %r' % (sys.argv[1:2], e), file=sys.stderr, flush=True)
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
