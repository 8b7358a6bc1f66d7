"""Nodelists, cluster hardware defaults and device meshes (realhf.txt section 4)."""

import pytest

from realloc.cluster import ClusterSpec, compress_nodelist, parse_nodelist


@pytest.mark.parametrize("text,expected", [
    ("com[01-03]", ("com01", "com02", "com03")),
    ("node[1-3,5]", ("node1", "node2", "node3", "node5")),
    ("a,b", ("a", "b")),
    ("localhost", ("localhost",)),
    ("trainer[08-10]", ("trainer08", "trainer09", "trainer10")),
    ("gpu[1-2],cpu7", ("gpu1", "gpu2", "cpu7")),
    ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
])
def test_parse_nodelist(text, expected):
    assert parse_nodelist(text) == expected


@pytest.mark.parametrize("text,msg", [
    ("", "empty"), ("com[01-03", "unmatched"), ("com[3-1]", "backwards"), ("com[a-b]", "bad range"),
    ("a,a", "twice"), ("com01]", "unmatched"),
])
def test_parse_nodelist_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_nodelist(text)


def test_compress_round_trip():
    assert compress_nodelist(parse_nodelist("com[01-08]")) == "com[01-08]"
    assert compress_nodelist(("a", "b")) == "a,b"
    assert compress_nodelist(("com09", "com10")) == "com[09-10]"


def test_hardware_defaults_and_overrides():
    c = ClusterSpec.from_nodelist("com[01-02]", 8, "a100-80g")
    # 10% of an A100's 80 GiB is held back for the CUDA context, NCCL and fragmentation
    assert c.n_devices == 16 and c.device_memory == int(80 * 2**30 * 0.9)
    assert "72.0 GiB each usable (of 80.0)" in c.describe()
    # an explicit device_memory is what the user can use, taken as given
    assert ClusterSpec.from_nodelist("com01", 8, "a100-80g", device_memory=80 * 2**30).device_memory == 80 * 2**30
    assert "usable" not in ClusterSpec.from_nodelist("localhost", device="cpu").describe()
    assert c.inter_node_bandwidth < c.intra_node_bandwidth
    c2 = ClusterSpec.from_nodelist("com[01-02]", 8, "a100-80g", inter_node_bandwidth=50e9)
    assert c2.inter_node_bandwidth == 50e9
    assert ClusterSpec.from_nodelist("localhost", device="cpu").n_devices_per_node == 2
    with pytest.raises(ValueError, match="unknown device kind 'tpu'.*a100-80g"):
        ClusterSpec.from_nodelist("a", 8, "tpu")
    with pytest.raises(ValueError, match="unknown cluster setting 'bandwidth'"):
        ClusterSpec.from_nodelist("a", 8, "cpu", bandwidth=1)
    with pytest.raises(ValueError, match="power of two"):
        ClusterSpec.from_nodelist("a", 6, "cpu")


def _hand_count_meshes(n_nodes: int, m: int) -> int:
    sub_node = sum(m // size for size in (2**k for k in range(10)) if size < m)
    runs = sum(n_nodes - k + 1 for k in range(1, n_nodes + 1))
    return n_nodes * sub_node + runs


@pytest.mark.parametrize("n,m", [(1, 1), (1, 4), (2, 8), (8, 8), (3, 2)])
def test_mesh_enumeration_count(n, m):
    c = ClusterSpec.from_nodelist(f"n[1-{n}]", m, "cpu")
    meshes = c.device_meshes()
    assert len(meshes) == _hand_count_meshes(n, m)
    assert len({x.name for x in meshes}) == len(meshes)
    for mesh in meshes:
        assert c.mesh(mesh.name) == mesh  # names parse back
        ids = mesh.device_ids
        assert len(ids) == mesh.size and mesh.size & (mesh.size - 1) == 0 or mesh.whole_nodes
        if not mesh.whole_nodes:  # aligned block inside one node
            assert mesh.dev_start % mesh.n_devs == 0


def test_mesh_names_and_overlap():
    c = ClusterSpec.from_nodelist("com[01-02]", 8, "a100-80g")
    whole, n1, left, right = c.mesh("com[01-02]"), c.mesh("com01"), c.mesh("com01:0-3"), c.mesh("com01:4-7")
    assert whole.device_ids == tuple(range(16)) and n1.device_ids == tuple(range(8))
    assert c.mesh("com02:6").device_ids == (14,)
    assert left.overlaps(n1) and not left.overlaps(right) and whole.contains(right)
    assert c.mesh("com02:4-7").name == "com02:4-7"


@pytest.mark.parametrize("name,msg", [
    ("com03", "not in the cluster"), ("com01:0-2", "aligned power-of-two"), ("com01:2-3", None),
    ("com01:3-4", "aligned"), ("com[01-02]:0-1", "only inside one node"), ("com01:x", "bad device range"),
    ("com01:8", "device 8 is out of range; node com01 has devices 0-7"), ("com01:6-9", "device 9 is out of range"),
])
def test_mesh_parse_errors(name, msg):
    c = ClusterSpec.from_nodelist("com[01-02]", 8, "a100-80g")
    if msg is None:
        assert c.mesh(name).device_ids == (2, 3)
    else:
        with pytest.raises(ValueError, match=msg):
            c.mesh(name)


def test_mesh_must_be_a_consecutive_run():
    c = ClusterSpec.from_nodelist("com[01-03]", 8, "a100-80g")
    with pytest.raises(ValueError, match="consecutive"):
        c.mesh("com01,com03")


def test_cpu_devices_share_the_hosts_cores():
    # profiles/hardware/cpu.json: a host of 2 cores; more devices than that share them.
    assert ClusterSpec.from_nodelist("localhost", 2, "cpu").cores_per_device == 1.0
    assert ClusterSpec.from_nodelist("localhost", 4, "cpu").cores_per_device == 0.5
    assert ClusterSpec.from_nodelist("localhost", 4, "cpu", cores_per_device=2).cores_per_device == 2.0
    # GPU hosts give each device its own cores (no cores_per_node in their spec)
    assert ClusterSpec.from_nodelist("com[01-02]", 8, "a100-80g").cores_per_device == 16


def test_mesh_on_a_device_the_node_does_not_have_says_so():
    c = ClusterSpec.from_nodelist("localhost", 2, "cpu")
    with pytest.raises(ValueError, match="mesh 'localhost:2': device 2 is out of range; node localhost has devices 0-1"):
        c.mesh("localhost:2")


@pytest.mark.parametrize("n", [0, -2, 3])
def test_devices_per_node_must_be_a_power_of_two_never_silently_the_default(n):
    with pytest.raises(ValueError, match=f"n_devices_per_node must be a power of two .*got {n}"):
        ClusterSpec.from_nodelist("localhost", n, "cpu")
    assert ClusterSpec.from_nodelist("localhost", None, "cpu").n_devices_per_node >= 1  # None: the default
