"""Nova's NeutronFixture with two networks and one address per port.

nova.tests.fixtures.NeutronFixture serves one network (`private`) and makes
every new port a copy of its canned port_2: network `private`, 192.168.1.30,
and the fixture's own test project as owner. Nova builds a server's network
info (its `addresses`) from the ports listed with the server's project and
id, so with that owner every server's `addresses` stayed `{}`, and a server
asked onto another network got a port on `private` anyway.

This variant changes only that:

- a second network, `lan2` (LAN2_NETWORK, subnet 10.42.0.0/24), besides
  `private` (3cb9bc59-5699-4588-a4b1-b87f96708bc6, 192.168.1.0/24); both
  owned by the fixture's project and not shared, so `"networks": "auto"`
  still auto-allocates `private` (Nova sees no network of its own project);
- a new port keeps what Nova asks for (network, project, device, security
  groups, a fixed IP), gets its own id, a MAC (the requested one, else
  fa:16:3e:xx:xx:xx) and the lowest free IPv4 address from .10 of its
  network's subnet;
- subnets are listed by the ids asked for.

Ports that Nova creates here are bound and listed as on a real Neutron, so
`GET /servers/{id}` shows `addresses` {network name: [fixed IP]} in port
order and os-interface lists the same ports. There is still no Neutron HTTP
API: a client cannot make a port itself.
"""

import copy
import ipaddress
import random

from oslo_utils import uuidutils

from nova.tests.fixtures import neutron as neutron_fixtures

Base = neutron_fixtures.NeutronFixture

LAN2_NETWORK = 'c2f1b6a4-6d0e-4d54-9a3e-7b1f0e5d2a42'
LAN2_SUBNET = 'e4a0c7d2-1b3f-4c8e-8f6a-2d9b5c1e7f30'
FIRST_HOST = 10

network_lan2 = dict(copy.deepcopy(Base.network_1), id=LAN2_NETWORK,
                    name='lan2', subnets=[LAN2_SUBNET],
                    **{'provider:segmentation_id': 25})
subnet_lan2 = dict(copy.deepcopy(Base.subnet_1), id=LAN2_SUBNET,
                   name='lan2-subnet', network_id=LAN2_NETWORK,
                   gateway_ip='10.42.0.1', cidr='10.42.0.0/24',
                   allocation_pools=[{'start': '10.42.0.2',
                                      'end': '10.42.0.254'}])


class VmletNeutronFixture(Base):

    def __init__(self, test):
        super().__init__(test)
        self._networks[LAN2_NETWORK] = network_lan2
        self._subnets[LAN2_SUBNET] = subnet_lan2

    def _v4_subnet(self, network_id):
        for subnet in self._subnets.values():
            if subnet['network_id'] == network_id and subnet['ip_version'] == 4:
                return subnet
        raise neutron_fixtures.neutron_client_exc.NeutronClientException(
            status_code=400, message='network %s has no IPv4 subnet' % network_id)

    def _free_address(self, subnet):
        cidr = ipaddress.ip_network(subnet['cidr'], strict=False)
        used = {ip['ip_address'] for port in self._ports.values()
                for ip in port.get('fixed_ips', [])}
        for host in list(cidr.hosts())[FIRST_HOST - 1:]:
            if str(host) not in used:
                return str(host)
        raise neutron_fixtures.neutron_client_exc.IpAddressGenerationFailureClient()

    def create_port(self, body=None):
        asked = copy.deepcopy((body or {'port': {}})['port'])
        network_id = asked.get('network_id', self.network_1['id'])
        if network_id not in self._networks:
            raise neutron_fixtures.neutron_client_exc.NetworkNotFoundClient()
        port = copy.deepcopy(self.default_port)
        port.update(asked)
        subnet = self._v4_subnet(network_id)
        fixed = [ip['ip_address'] for ip in asked.get('fixed_ips', [])
                 if ip.get('ip_address')]
        port.update({
            'id': uuidutils.generate_uuid(),
            'network_id': network_id,
            'mac_address': asked.get('mac_address') or 'fa:16:3e:' + ':'.join(
                '%02x' % random.randint(0, 255) for _ in range(3)),
            'fixed_ips': [{'ip_address': ip, 'subnet_id': subnet['id']}
                          for ip in fixed] or
                         [{'ip_address': self._free_address(subnet),
                           'subnet_id': subnet['id']}],
        })
        self._ports[port['id']] = port
        return {'port': copy.deepcopy(port)}

    def list_subnets(self, retrieve_all=True, **_params):
        return {'subnets': self._list_resource(
            self._subnets, retrieve_all, **_params)}
