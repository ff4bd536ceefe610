"""A small OpenStack Cinder (block storage) in one process, for vmlet's
integration tests.

    python cinder_serve.py   (started by hack/nova.sh; settings from the
                              environment and $VMLET_NOVA_DIR/etc/cinder)

What runs here, all of it Cinder's own code (eventlet, as Cinder's
services are written for):

- cinder-api: the real WSGI service (`osapi_volume`, the api-paste.ini
  pipeline with keystonemiddleware authtoken) on
  127.0.0.1:$VMLET_CINDER_PORT;
- cinder-scheduler;
- one cinder-volume service for the backend `fake`, whose driver is the
  FakeLoggingVolumeDriver that Cinder ships in its wheel
  (cinder.tests.fake_driver): volumes, attachments and extensions go
  through Cinder's real API, database, scheduler and volume manager, and
  the driver only logs instead of touching block devices;
- RPC between them on oslo.messaging's in-process `fake://` transport.

The database is a real sqlite file made by Cinder's own migrations (as
`cinder-manage db sync`), which also create the default volume type
`__DEFAULT__`. Nova (serve.py) reaches this API over HTTP, as a real
cloud's Nova does, when it attaches a volume to a server.

Just before the API starts listening, $VMLET_NOVA_DIR/cinder-ready is
written. A failure while starting exits the process (status 1).
"""

from cinder import monkey_patch
monkey_patch.patch()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from oslo_config import cfg  # noqa: E402
from oslo_log import log as logging  # noqa: E402

from cinder.common import config  # noqa: E402
from cinder.common import constants  # noqa: E402
from cinder import coordination  # noqa: E402
from cinder.db import migration  # noqa: E402
from cinder import i18n  # noqa: E402
from cinder import objects  # noqa: E402
from cinder import rpc  # noqa: E402
from cinder import service  # noqa: E402
from cinder import version  # noqa: E402

i18n.enable_lazy()
CONF = cfg.CONF
LOG = logging.getLogger('vmlet.cinder.serve')
STATE = os.environ['VMLET_NOVA_DIR']
BACKEND = 'fake'


def step(what, started=[time.monotonic()]):
    LOG.info('vmlet cinder: %s (%.1f s)', what, time.monotonic() - started[0])


def own_heartbeat(svc):
    """cinder.service.Service keeps the service's database id on the class
    (Cinder runs one service per process), so in one process every
    heartbeat would go to the last service's row and the volume service
    would look down to the scheduler. Give `svc` (not started yet) a
    heartbeat that writes its own row; green threads switch only at I/O,
    and the heartbeat's sqlite calls do not yield."""
    report = svc.report_state

    def report_state():
        service.Service.service_id = svc.origin_service_id
        report()
    svc.report_state = report_state
    return svc


def main():
    objects.register_all()
    CONF(['--config-file', os.path.join(STATE, 'etc', 'cinder', 'cinder.conf')],
         project='cinder', version=version.version_string())
    config.set_middleware_defaults()
    logging.setup(CONF, 'cinder')
    step('configuration loaded')
    migration.db_sync()
    step('database migrated')
    coordination.COORDINATOR.start()
    rpc.init(CONF)
    # The volume service first: the scheduler, as it starts, asks the volume
    # services for their capabilities and waits (up to
    # scheduler_driver_init_wait_time) for the first answer.
    volume = own_heartbeat(service.Service.create(
        host='%s@%s' % (CONF.host, BACKEND), service_name=BACKEND,
        binary=constants.VOLUME_BINARY, coordination=True))
    volume.start()
    scheduler = own_heartbeat(service.Service.create(
        binary='cinder-scheduler'))
    scheduler.start()
    step('scheduler and volume service started')
    api = service.WSGIService('osapi_volume')
    with open(os.path.join(STATE, 'cinder-ready'), 'w') as f:
        f.write(json.dumps({'pid': os.getpid()}) + '\n')
    api.start()
    step('serving on %s:%s' % (api.host, api.port))
    # The services run in green threads; this one only keeps the process
    # alive (SIGTERM ends it).
    while True:
        time.sleep(3600)


if __name__ == '__main__':
    try:
        main()
    except BaseException:
        LOG.exception('vmlet cinder: start failed')
        sys.stderr.flush()
        os._exit(1)
