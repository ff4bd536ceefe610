"""Nova's fake virt driver with the capacity of a small real hypervisor.

nova.virt.fake.FakeDriver reports 1000 vCPUs, 800000 MB RAM and 600000 GB
disk per node, so nothing vmlet does would ever be refused for lack of room
and its capacity arithmetic would not be exercised. This variant changes only
those numbers (the class attributes FakeDriver reads for both the
hypervisor record and the Placement inventory). Selected in nova.conf with
`compute_driver = vmlet_fake_driver.VmletFakeDriver`: Nova loads drivers only
as nova.virt.<compute_driver>, so serve.py registers this module under
nova.virt.vmlet_fake_driver in sys.modules.
"""

import os

from nova.virt import fake


class VmletFakeDriver(fake.FakeDriver):
    vcpus = int(os.environ.get('VMLET_NOVA_HOST_VCPUS', '8'))
    memory_mb = int(os.environ.get('VMLET_NOVA_HOST_RAM_MB', '16384'))
    local_gb = int(os.environ.get('VMLET_NOVA_HOST_DISK_GB', '200'))
