"""Fill a freshly bootstrapped Keystone with what Nova and vmlet need.

    python keystone_setup.py   (settings from the environment, see below)

`keystone-manage bootstrap` made the admin user, project `admin`, region and
the identity endpoints. This adds, through Keystone's own v3 REST API:

- role `service`, project `service`, and the service users `nova`,
  `placement` and `cinder` (roles admin + service on project `service`):
  nova-api's, placement's and cinder-api's authtoken middleware validate
  tokens with them, and Nova talks to Placement as `nova`;
- project `vmlet` with user `vmlet` (role member), for tests that need a
  non-admin user;
- services `compute`, `placement` and Cinder's `volumev3` and
  `block-storage` (one API, under both types as devstack registers it) with
  public, internal and admin endpoints in the region.

Stdlib only. Every request has a timeout; any failure exits non-zero with the
HTTP status and body. Environment: KEYSTONE_URL (…/v3), OS_PASSWORD (admin),
OS_REGION_NAME, NOVA_URL (…/v2.1), PLACEMENT_URL, CINDER_URL
(…/v3/%(project_id)s), SERVICE_PASSWORD,
VMLET_PASSWORD.
"""

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT = 15
ENV = os.environ
KEYSTONE = ENV['KEYSTONE_URL'].rstrip('/')


def request(method, path, token=None, body=None, ok=(200, 201, 204)):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(KEYSTONE + path, data=data, method=method)
    req.add_header('Content-Type', 'application/json')
    if token:
        req.add_header('X-Auth-Token', token)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            raw = resp.read()
            status, headers = resp.status, resp.headers
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, e.headers
    if status not in ok:
        sys.exit('keystone_setup: %s %s -> %s %s'
                 % (method, path, status, raw.decode(errors='replace')))
    return (json.loads(raw) if raw else {}), headers


def admin_token():
    body = {'auth': {
        'identity': {'methods': ['password'], 'password': {'user': {
            'name': 'admin', 'domain': {'id': 'default'},
            'password': ENV['OS_PASSWORD']}}},
        'scope': {'project': {'name': 'admin', 'domain': {'id': 'default'}}},
    }}
    _, headers = request('POST', '/auth/tokens', body=body)
    return headers['X-Subject-Token']


def ensure(token, collection, name, attrs=None, query=None):
    """Return the id of the named entity, creating it when missing."""
    singular = collection[:-1]
    found, _ = request('GET', '/%s?name=%s%s' % (collection, name,
                                                  query or ''), token)
    if found[collection]:
        return found[collection][0]['id']
    entity = dict(attrs or {}, name=name)
    made, _ = request('POST', '/' + collection, token, {singular: entity})
    return made[singular]['id']


def grant(token, project_id, user_id, role_id):
    request('PUT', '/projects/%s/users/%s/roles/%s'
            % (project_id, user_id, role_id), token)


def ensure_service(token, svc_type, name, url):
    found, _ = request('GET', '/services?type=' + svc_type, token)
    if found['services']:
        svc_id = found['services'][0]['id']
    else:
        made, _ = request('POST', '/services', token, {'service': {
            'type': svc_type, 'name': name, 'enabled': True}})
        svc_id = made['service']['id']
    have, _ = request('GET', '/endpoints?service_id=' + svc_id, token)
    have = {e['interface'] for e in have['endpoints']}
    for interface in ('public', 'internal', 'admin'):
        if interface not in have:
            request('POST', '/endpoints', token, {'endpoint': {
                'service_id': svc_id, 'interface': interface, 'url': url,
                'region_id': ENV['OS_REGION_NAME'], 'enabled': True}})


def main():
    token = admin_token()
    dom = {'domain_id': 'default'}
    roles = {name: ensure(token, 'roles', name)
             for name in ('admin', 'member', 'reader', 'service')}
    service_project = ensure(token, 'projects', 'service',
                             dict(dom, description='OpenStack services'))
    for user in ('nova', 'placement', 'cinder'):
        user_id = ensure(token, 'users', user,
                         dict(dom, password=ENV['SERVICE_PASSWORD']))
        grant(token, service_project, user_id, roles['admin'])
        grant(token, service_project, user_id, roles['service'])
    vmlet_project = ensure(token, 'projects', 'vmlet',
                           dict(dom, description='vmlet tests (non-admin)'))
    vmlet_user = ensure(token, 'users', 'vmlet', dict(
        dom, password=ENV['VMLET_PASSWORD'],
        default_project_id=vmlet_project))
    grant(token, vmlet_project, vmlet_user, roles['member'])
    grant(token, vmlet_project, vmlet_user, roles['reader'])
    ensure_service(token, 'compute', 'nova', ENV['NOVA_URL'])
    ensure_service(token, 'placement', 'placement', ENV['PLACEMENT_URL'])
    ensure_service(token, 'volumev3', 'cinderv3', ENV['CINDER_URL'])
    ensure_service(token, 'block-storage', 'cinder', ENV['CINDER_URL'])
    print('keystone_setup: projects service + vmlet, users nova, placement, '
          'cinder, vmlet; compute, placement, volumev3 and block-storage '
          'endpoints registered')


if __name__ == '__main__':
    main()
