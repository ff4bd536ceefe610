"""A small OpenStack Nova cloud in one process, for vmlet's integration tests.

    python serve.py   (started by hack/nova.sh; settings from the environment)

What runs here, all of it Nova's own code in native-threading mode:

- nova-api: the real WSGI app (nova.api.openstack.wsgi_app, what
  nova.wsgi.osapi_compute serves) with the real api-paste.ini pipeline,
  keystonemiddleware authtoken included, served by cheroot on
  127.0.0.1:$VMLET_NOVA_PORT;
- nova-conductor and nova-scheduler (host `nova-ctl`);
- one nova-compute service per host in $VMLET_NOVA_HOSTS, each with its own
  VmletFakeDriver (Nova's fake virt driver, see vmlet_fake_driver.py);
- RPC between them on oslo.messaging's in-process `fake://` transport.

Databases are real sqlite files in the state directory (API database, cell0
and cell1), made by Nova's own migrations and cell mappings, as
`nova-manage api_db sync`, `cell_v2 map_cell0`, `cell_v2 create_cell`,
`db sync` and `cell_v2 discover_hosts` would. Keystone and Placement are
separate real services (hack/nova.sh starts them); this process migrates
its databases meanwhile and waits for them (a `nova` token whose catalog
lists placement and compute) before starting the services, whose Placement
clients authenticate at once; the computes report to Placement over HTTP.

Test doubles from Nova's functional tests (nova.tests.fixtures) stand in for
the services Nova only talks to: GlanceFixture (images) and NeutronFixture
(networks and ports; vmlet_neutron.py adds a second network and gives each
port its own address). Volumes are real: Nova calls the Cinder API that
cinder_serve.py runs (hack/nova.sh starts it), over HTTP, with the
caller's token and Keystone's catalog. Two more helpers from there
make one process behave as several hosts: DatabaseWriteLock (one sqlite
writer at a time) and ComputeNodeIdFixture (no shared compute_id file).

Just before the API starts listening, $VMLET_NOVA_DIR/nova-ready is
written. A failure while starting exits the process (status 1).
SIGTERM or SIGINT ends the process.
"""

import os
import sys

# Nova's services default to eventlet; the WSGI entry point and this process
# use native threads. Must be set before nova is imported.
os.environ.setdefault('OS_NOVA_DISABLE_EVENTLET_PATCHING', '1')
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from nova import monkey_patch  # noqa: E402
monkey_patch.patch(backend='threading')

import json  # noqa: E402
import sqlite3  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

import fixtures  # noqa: E402
from oslo_log import log as logging  # noqa: E402

from nova.api.openstack import wsgi_app  # noqa: E402
from nova.compute import api as compute_api  # noqa: E402
from nova.compute import rpcapi as compute_rpcapi  # noqa: E402
import nova.conf  # noqa: E402
from nova import context as nova_context  # noqa: E402
from nova.db import migration  # noqa: E402
from nova import objects  # noqa: E402
from nova.objects import host_mapping  # noqa: E402
from nova import service  # noqa: E402
from nova.tests import fixtures as nova_fixtures  # noqa: E402

import vmlet_fake_driver  # noqa: E402
import vmlet_neutron  # noqa: E402
import wsgi_serve  # noqa: E402

# Nova imports drivers as nova.virt.<compute_driver> only.
sys.modules['nova.virt.vmlet_fake_driver'] = vmlet_fake_driver

CONF = nova.conf.CONF
LOG = logging.getLogger('vmlet.nova.serve')
ENV = os.environ
STATE = ENV['VMLET_NOVA_DIR']
CONF_DIR = os.path.join(STATE, 'etc', 'nova')
CTL_HOST = 'nova-ctl'
# Flavor grid: c{vcpus}-m{MiB}, 1 GB disk; flavor id = name.
GRID_VCPUS = (1, 2, 4)
GRID_RAM_MB = (256, 512, 1024, 2048, 4096)
# (name, id, vcpus, MiB, GB) as in a classic devstack.
CLASSIC_FLAVORS = (('m1.tiny', '1', 1, 512, 1), ('m1.small', '2', 1, 2048, 20))


def step(what, started=[time.monotonic()]):
    LOG.info('vmlet serve: %s (%.1f s)', what, time.monotonic() - started[0])


class Cloud(fixtures.Fixture):
    """The parts of nova.test.TestCase that the test-double fixtures expect
    of their `test` argument: useFixture, stub_out and flags."""

    def stub_out(self, old, new):
        self.useFixture(fixtures.MonkeyPatch(old, new))

    def flags(self, **kw):
        group = kw.pop('group', None)
        for k, v in kw.items():
            CONF.set_override(k, v, group)


def load_config():
    """Parse nova.conf and set up logging, as the WSGI entry point does."""
    conf_files = [os.path.join(CONF_DIR, 'api-paste.ini'),
                  os.path.join(CONF_DIR, 'nova.conf')]
    os.environ['OS_NOVA_CONFIG_DIR'] = CONF_DIR
    # init_global_data parses sys.argv as the command line.
    sys.argv = ['nova-api-os-compute']
    wsgi_app.init_global_data(conf_files, 'osapi_compute',
                              'nova-api-os-compute')


def sqlite_path(url):
    return url[len('sqlite:///'):]


def new_sqlite(url):
    """An empty sqlite file in WAL mode: readers then do not block the one
    writer (as the functional tests' file-backed databases do)."""
    with sqlite3.connect(sqlite_path(url)) as conn:
        conn.execute('PRAGMA journal_mode=WAL')


def create_databases(ctxt):
    """nova-manage api_db sync, cell_v2 map_cell0, cell_v2 create_cell and
    db sync, in-process: the API database, cell0 and cell1 (whose database is
    [database]connection, the one the conductor and computes use)."""
    cell0_url = 'sqlite:///' + os.path.join(STATE, 'nova_cell0.sqlite')
    cell1_url = CONF.database.connection
    for url in (CONF.api_database.connection, cell0_url, cell1_url):
        new_sqlite(url)
    migration.db_sync(database='api')
    step('API database migrated')
    cell0 = objects.CellMapping(
        ctxt, uuid=objects.CellMapping.CELL0_UUID, name='cell0',
        transport_url='none:///', database_connection=cell0_url)
    cell0.create()
    cell1 = objects.CellMapping(
        ctxt, uuid='7d2a4ab3-2a57-4c49-b1f4-0c1e2e7f0001', name='cell1',
        transport_url=CONF.transport_url, database_connection=cell1_url)
    cell1.create()
    migration.db_sync(database='main')
    step('cell1 database migrated')
    with nova_context.target_cell(ctxt, cell0) as cctxt:
        migration.db_sync(database='main', context=cctxt)
    step('cell0 database migrated')


def catalog_url(token_body, service_type):
    for svc in token_body['token'].get('catalog', []):
        if svc['type'] == service_type:
            for ep in svc['endpoints']:
                if ep['interface'] == 'public':
                    return ep['url']
    return None


def wait_for_identity_and_placement(deadline):
    """Block until Keystone issues the `nova` service user a token whose
    catalog has Placement and Compute (hack/nova/keystone_setup.py has run),
    and Placement answers: the computes report their inventory at start."""
    auth = {'auth': {
        'identity': {'methods': ['password'], 'password': {'user': {
            'name': 'nova', 'domain': {'id': 'default'},
            'password': ENV['VMLET_NOVA_SERVICE_PASSWORD']}}},
        'scope': {'project': {'name': 'service',
                              'domain': {'id': 'default'}}}}}
    last = None
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(
                ENV['VMLET_KEYSTONE_URL'] + '/auth/tokens',
                data=json.dumps(auth).encode(), method='POST',
                headers={'Content-Type': 'application/json'})
            with urllib.request.urlopen(req, timeout=5) as resp:
                token = resp.headers['X-Subject-Token']
                body = json.load(resp)
            placement = catalog_url(body, 'placement')
            if not placement or not catalog_url(body, 'compute'):
                raise OSError('placement/compute not in the catalog yet')
            req = urllib.request.Request(placement + '/resource_providers',
                                         headers={'X-Auth-Token': token})
            with urllib.request.urlopen(req, timeout=5):
                return
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = e
        time.sleep(0.5)
    raise SystemExit('Keystone/Placement not ready in time: %s' % last)


def start_service(binary, host, **kwargs):
    svc = service.Service.create(binary=binary, host=host, **kwargs)
    svc.start()
    return svc


def start_computes(hosts):
    services = []
    for host in hosts:
        # Each compute gets its host name passed in; CONF.host is also set
        # while it starts because the fake driver reads it in __init__.
        CONF.set_override('host', host)
        services.append(start_service(
            'nova-compute', host, topic=compute_rpcapi.RPC_TOPIC,
            topic_alt=compute_rpcapi.RPC_TOPIC_ALT))
        step('nova-compute %s started' % host)
    CONF.set_override('host', CTL_HOST)
    return services


def create_flavors(ctxt):
    specs = [('c%d-m%d' % (c, m), 'c%d-m%d' % (c, m), c, m, 1)
             for c in GRID_VCPUS for m in GRID_RAM_MB]
    for name, flavorid, vcpus, ram, disk in specs + list(CLASSIC_FLAVORS):
        objects.Flavor(ctxt, name=name, flavorid=flavorid, vcpus=vcpus,
                       memory_mb=ram, root_gb=disk, ephemeral_gb=0, swap=0,
                       rxtx_factor=1.0, is_public=True).create()


def create_zones(ctxt, zones):
    """Host aggregates with availability_zone metadata, through Nova's own
    aggregate API (which also mirrors them into Placement)."""
    agg_api = compute_api.AggregateAPI()
    by_zone = {}
    for host, zone in zones.items():
        by_zone.setdefault(zone, []).append(host)
    for zone, hosts in sorted(by_zone.items()):
        agg = agg_api.create_aggregate(ctxt, zone, zone)
        for host in hosts:
            agg_api.add_host_to_aggregate(ctxt, agg.id, host)
        step('aggregate %s (availability zone %s): %s'
             % (zone, zone, ','.join(hosts)))


def main():
    deadline = time.monotonic() + float(ENV.get('VMLET_NOVA_START_TIMEOUT',
                                                '200'))
    hosts = ENV.get('VMLET_NOVA_HOSTS', 'nova-a,nova-b,nova-c').split(',')
    zones = dict(pair.split('=') for pair in ENV.get(
        'VMLET_NOVA_ZONES', 'nova-a=az1,nova-b=az1,nova-c=az2').split(','))
    load_config()
    step('configuration loaded')
    cloud = Cloud()
    cloud.setUp()
    # One writer per sqlite database at a time across this process's threads
    # (the API, conductor, scheduler and computes all write the same files).
    cloud.useFixture(nova_fixtures.DatabaseWriteLock())
    # The computes share one state_path here; keep the per-host compute_id
    # file (a single-host guard) out of the way.
    cloud.useFixture(nova_fixtures.ComputeNodeIdFixture())
    ctxt = nova_context.get_admin_context()
    create_databases(ctxt)
    glance = cloud.useFixture(nova_fixtures.GlanceFixture(cloud))
    neutron = cloud.useFixture(vmlet_neutron.VmletNeutronFixture(cloud))
    step('glance/neutron test doubles installed')
    create_flavors(ctxt)
    # Conductor, scheduler and the API set up Placement clients as they
    # start, which authenticate as `nova` right away.
    wait_for_identity_and_placement(deadline)
    step('keystone and placement answer')
    start_service('nova-conductor', CTL_HOST, topic='conductor')
    start_service('nova-scheduler', CTL_HOST, topic='scheduler')
    step('conductor and scheduler started')
    app = wsgi_app.init_application('osapi_compute', 'nova-api-os-compute')
    step('API application loaded')
    start_computes(hosts)
    for mapping in host_mapping.discover_hosts(ctxt):
        step('discovered host %s' % mapping.host)
    create_zones(ctxt, zones)
    step('serving (image %s, networks %s)'
         % (glance.image1['id'], ', '.join(
             '%s %s' % (n['name'], n['id'])
             for n in neutron._networks.values())))
    with open(os.path.join(STATE, 'nova-ready'), 'w') as f:
        f.write(json.dumps({'pid': os.getpid(), 'hosts': hosts}) + '\n')
    wsgi_serve.serve('nova-api', app, int(ENV['VMLET_NOVA_PORT']),
                     int(ENV.get('VMLET_NOVA_API_THREADS', '16')))


if __name__ == '__main__':
    try:
        main()
    except BaseException:
        # The started services' threads would keep a failed process alive.
        LOG.exception('vmlet serve: start failed')
        sys.stderr.flush()
        os._exit(1)
