"""Drive the Nova harness over real HTTP as a vmlet provider would.

    eval "$(hack/nova.sh env)"
    python3 hack/nova/smoke.py            # the whole walk, ~15 s
    python3 hack/nova/smoke.py --ready    # one readiness check (for nova.sh)

Stdlib only (urllib, json); every request has a timeout and every wait a
deadline. Any failure exits non-zero with the HTTP status and body.

Microversions: the walk sends 2.74 (server create with "host", 2.74; cold
migrate with "host", 2.56; os-migrateLive with block_migration "auto", 2.25;
the rest works from 2.1) except os-hypervisors, which is read at 2.53: 2.88
dropped vcpus/memory_mb from hypervisors (Placement has them since).
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid

TIMEOUT = 30
# Nova refuses metadata keys outside ^[a-zA-Z0-9-_:. ]{1,255}$ (HTTP 400),
# so a Kubernetes-style 'vmlet.io/uid' cannot be a key; ':' can stand for '/'.
UID_KEY = 'vmlet.io:uid'
MV_SERVERS = '2.74'
MV_HYPERVISORS = '2.53'


class Failure(Exception):
    pass


def env(name, default=None):
    value = os.environ.get(name, default)
    if value is None:
        raise Failure('%s is not set: eval "$(hack/nova.sh env)" first' % name)
    return value


def http(method, url, token=None, body=None, microversion=None,
         ok=(200, 201, 202, 204), timeout=TIMEOUT):
    """One request; returns (status, headers, parsed JSON body or None)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header('Accept', 'application/json')
    if data is not None:
        req.add_header('Content-Type', 'application/json')
    if token:
        req.add_header('X-Auth-Token', token)
    if microversion:
        req.add_header('OpenStack-API-Version', 'compute ' + microversion)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, headers, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, e.headers, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise Failure('%s %s: %s' % (method, url, e))
    if status not in ok:
        raise Failure('%s %s -> HTTP %s\n%s' % (
            method, url, status, raw.decode(errors='replace')))
    parsed = json.loads(raw) if raw and raw.strip() else None
    return status, headers, parsed


def keystone_auth(identity, scope=None):
    """POST /v3/auth/tokens; returns (token, token body)."""
    auth = {'identity': identity}
    if scope:
        auth['scope'] = scope
    _, headers, body = http('POST', env('OS_AUTH_URL').rstrip('/') +
                            '/auth/tokens', body={'auth': auth})
    return headers['X-Subject-Token'], body['token']


def password_auth():
    return keystone_auth(
        {'methods': ['password'], 'password': {'user': {
            'name': env('OS_USERNAME'), 'password': env('OS_PASSWORD'),
            'domain': {'name': env('OS_USER_DOMAIN_NAME', 'Default')}}}},
        {'project': {'name': env('OS_PROJECT_NAME'), 'domain': {
            'name': env('OS_PROJECT_DOMAIN_NAME', 'Default')}}})


def endpoint(token_body, service_type):
    """The catalog URL for the service in OS_REGION_NAME / OS_INTERFACE."""
    region, interface = env('OS_REGION_NAME'), env('OS_INTERFACE', 'public')
    for svc in token_body.get('catalog', []):
        if svc['type'] != service_type:
            continue
        for ep in svc['endpoints']:
            if ep['interface'] == interface and ep['region_id'] == region:
                return ep['url'].rstrip('/')
    raise Failure('no %s endpoint (%s, %s) in the catalog'
                  % (service_type, region, interface))


def hypervisors(nova, token):
    _, _, body = http('GET', nova + '/os-hypervisors/detail', token,
                      microversion=MV_HYPERVISORS)
    return body['hypervisors']


def ready():
    """Exit 0 when a token can be had, every host in VMLET_NOVA_HOSTS is a
    hypervisor that is up and enabled, and a cinder-volume service is up."""
    token, body = password_auth()
    nova = endpoint(body, 'compute')
    found = {h['hypervisor_hostname']: h for h in hypervisors(nova, token)}
    missing = []
    for host in env('VMLET_NOVA_HOSTS').split(','):
        h = found.get(host)
        if not h or h['state'] != 'up' or h['status'] != 'enabled':
            missing.append('%s (%s)' % (host, h and h['state'] or 'absent'))
    if missing:
        raise Failure('hypervisors not up: ' + ', '.join(missing))
    cinder = endpoint(body, 'volumev3')
    _, _, services = http('GET', cinder + '/os-services?binary=cinder-volume',
                          token)
    volume_up = [s['host'] for s in services['services']
                 if s['state'] == 'up' and s['status'] == 'enabled']
    if not volume_up:
        raise Failure('no cinder-volume service is up: %s'
                      % services['services'])
    print('ready: token ok, hypervisors up: ' + ', '.join(sorted(found)) +
          '; cinder-volume up: ' + ', '.join(volume_up))


class Walk:
    def __init__(self):
        self.t0 = time.monotonic()

    def step(self, name, microversion, fn):
        start = time.monotonic()
        try:
            result = fn()
        except Failure as e:
            print('FAIL %-44s %s' % (name, e), flush=True)
            raise SystemExit(1)
        print('ok   %-44s %6.2f s  (microversion %s)'
              % (name, time.monotonic() - start, microversion), flush=True)
        return result

    def wait(self, what, check, deadline_s=90, interval=0.5):
        deadline = time.monotonic() + deadline_s
        last = None
        while time.monotonic() < deadline:
            done, last = check()
            if done:
                return last
            time.sleep(interval)
        raise Failure('%s: not within %d s; last seen: %s'
                      % (what, deadline_s, json.dumps(last)[:2000]))


def run():
    w = Walk()
    mv = MV_SERVERS
    token, tbody = w.step('keystone v3 password auth (project scope)', '-',
                          password_auth)
    nova = w.step('compute endpoint from the catalog', '-',
                  lambda: endpoint(tbody, 'compute'))
    print('     compute endpoint: %s' % nova)

    def version():
        _, _, body = http('GET', nova + '/', token)
        return body['version']
    ver = w.step('version document', '-', version)
    print('     %s: min microversion %s, max %s'
          % (ver['id'], ver['min_version'], ver['version']))

    def show_hypervisors():
        hvs = hypervisors(nova, token)
        for h in hvs:
            print('     hypervisor %-8s state %-4s status %-8s vcpus %3s '
                  'memory_mb %6s local_gb %4s'
                  % (h['hypervisor_hostname'], h['state'], h['status'],
                     h['vcpus'], h['memory_mb'], h['local_gb']))
        return hvs
    w.step('os-hypervisors/detail', MV_HYPERVISORS, show_hypervisors)

    def server(sid):
        return http('GET', '%s/servers/%s' % (nova, sid), token,
                    microversion=mv)[2]['server']

    def until(sid, status, host=None, deadline_s=90):
        def check():
            s = server(sid)
            if s['status'] == 'ERROR':
                raise Failure('server went to ERROR: %s'
                              % json.dumps(s.get('fault')))
            done = (s['status'] == status and not s.get('OS-EXT-STS:task_state')
                    and (host is None or s['OS-EXT-SRV-ATTR:host'] == host))
            return done, {k: s.get(k) for k in (
                'status', 'OS-EXT-STS:task_state', 'OS-EXT-SRV-ATTR:host',
                'flavor')}
        return w.wait('server %s -> %s%s' % (sid, status, host and ' on ' +
                                              host or ''), check, deadline_s)

    def action(sid, body, ok=(202,)):
        http('POST', '%s/servers/%s/action' % (nova, sid), token, body,
             microversion=mv, ok=ok)

    uid = str(uuid.uuid4())
    image = env('VMLET_NOVA_IMAGE')
    network = env('VMLET_NOVA_NETWORK')

    def create_body(key):
        return {'server': {
            'name': 'vmlet-smoke-' + uid[:8], 'imageRef': image,
            'flavorRef': 'c1-m256', 'host': 'nova-a',
            'networks': [{'uuid': network}],
            'metadata': {key: uid}}}

    w.step("metadata key 'vmlet.io/uid' refused (400)", '2.1', lambda: http(
        'POST', nova + '/servers', token, create_body('vmlet.io/uid'),
        microversion=mv, ok=(400,)))

    def create():
        _, _, resp = http('POST', nova + '/servers', token,
                          create_body(UID_KEY), microversion=mv, ok=(202,))
        return resp['server']['id']
    sid = w.step('create server (host nova-a, c1-m256)', '2.74', create)
    print('     server %s (%s %s)' % (sid, UID_KEY, uid))
    s = w.step('wait ACTIVE on nova-a', mv, lambda: until(sid, 'ACTIVE',
                                                          'nova-a'))
    if server(sid)['metadata'].get(UID_KEY) != uid:
        raise SystemExit('FAIL metadata %s not kept' % UID_KEY)

    w.step('os-stop', '2.1', lambda: action(sid, {'os-stop': None}))
    w.step('wait SHUTOFF', mv, lambda: until(sid, 'SHUTOFF'))
    w.step('os-start', '2.1', lambda: action(sid, {'os-start': None}))
    w.step('wait ACTIVE', mv, lambda: until(sid, 'ACTIVE'))

    def move(name, microversion, body, target, confirm):
        """A move to a host the server is not on yet (a refused move also
        ends in ACTIVE on the old host, so the precondition matters)."""
        here = server(sid)['OS-EXT-SRV-ATTR:host']
        if here == target:
            raise SystemExit('FAIL %s: server is on %s already' % (name,
                                                                   target))
        w.step('%s (from %s)' % (name, here), microversion,
               lambda: action(sid, body))
        if confirm:
            w.step('wait VERIFY_RESIZE', mv,
                   lambda: until(sid, 'VERIFY_RESIZE', target))
            w.step('confirmResize', '2.1',
                   lambda: action(sid, {'confirmResize': None}, ok=(204,)))
        return w.step('wait ACTIVE on %s' % (target or 'another host'), mv,
                      lambda: until(sid, 'ACTIVE', target))

    move('os-migrateLive to nova-b', '2.25', {'os-migrateLive': {
        'host': 'nova-b', 'block_migration': 'auto'}}, 'nova-b', False)
    move('migrate (cold) to nova-c', '2.56',
         {'migrate': {'host': 'nova-c'}}, 'nova-c', True)

    # Nova's default allow_resize_to_same_host=False: a resize is a cold
    # migration to a host the scheduler picks, never the current one.
    w.step('resize to c2-m512', '2.1',
           lambda: action(sid, {'resize': {'flavorRef': 'c2-m512'}}))
    w.step('wait VERIFY_RESIZE', mv, lambda: until(sid, 'VERIFY_RESIZE'))
    w.step('confirmResize', '2.1',
           lambda: action(sid, {'confirmResize': None}, ok=(204,)))
    s = w.step('wait ACTIVE', mv, lambda: until(sid, 'ACTIVE'))
    if s['flavor'].get('original_name') != 'c2-m512':
        raise SystemExit('FAIL flavor after resize: %s' % s['flavor'])
    if s['OS-EXT-SRV-ATTR:host'] == 'nova-c':
        raise SystemExit('FAIL resize stayed on nova-c')
    print('     flavor now %s (%s vcpus, %s MiB), moved nova-c -> %s' % (
        s['flavor']['original_name'], s['flavor']['vcpus'],
        s['flavor']['ram'], s['OS-EXT-SRV-ATTR:host']))

    def console():
        _, _, body = http('POST', '%s/servers/%s/action' % (nova, sid),
                          token, {'os-getConsoleOutput': {'length': 5}},
                          microversion=mv, ok=(200,))
        return body['output']
    out = w.step('os-getConsoleOutput', '2.1', console)
    print('     console: %r' % out[:80])

    w.step('delete', '2.1', lambda: http(
        'DELETE', '%s/servers/%s' % (nova, sid), token, microversion=mv,
        ok=(204,)))

    def gone():
        status, _, _ = http('GET', '%s/servers/%s' % (nova, sid), token,
                            microversion=mv, ok=(200, 404))
        return status == 404, status
    w.step('wait gone (404)', mv, lambda: w.wait('server deleted', gone))

    keystone = env('OS_AUTH_URL').rstrip('/')
    user_id = tbody['user']['id']

    def app_credential():
        _, _, body = http(
            'POST', '%s/users/%s/application_credentials' % (keystone,
                                                             user_id),
            token, {'application_credential': {
                'name': 'vmlet-smoke-' + uid[:8],
                'description': 'hack/nova/smoke.py'}}, ok=(201,))
        cred = body['application_credential']
        try:
            ac_token, ac_body = keystone_auth({
                'methods': ['application_credential'],
                'application_credential': {'id': cred['id'],
                                           'secret': cred['secret']}})
            http('GET', endpoint(ac_body, 'compute') + '/servers', ac_token,
                 microversion=mv)
        finally:
            http('DELETE', '%s/users/%s/application_credentials/%s'
                 % (keystone, user_id, cred['id']), token, ok=(204,))
    w.step('application credential auth + GET /servers', mv, app_credential)
    print('smoke: all steps passed in %.1f s' % (time.monotonic() - w.t0))


def main():
    try:
        if sys.argv[1:] == ['--ready']:
            ready()
        elif sys.argv[1:]:
            sys.exit(__doc__)
        else:
            run()
    except Failure as e:
        print('FAIL %s' % e, file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    main()
