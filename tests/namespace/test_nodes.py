"""The inode table: a new version of a file updates its node in place, or, with versioned inodes
(FUSE passthrough on a mount whose objects change), gets a node of its own while the old node
keeps its version for whoever holds it."""

from cachefs.namespace.nodes import NodeTable
from cachefs.store import ObjectInfo


def info(etag: str, size: int = 10) -> ObjectInfo:
    return ObjectInfo("d/f", size, 1.0, etag)


def test_a_new_version_updates_the_node_in_place_by_default():
    table = NodeTable(0.0)
    node = table.node_for("d/f", False, info("v1"), 1.0)
    assert table.node_for("d/f", False, info("v2", 20), 2.0) is node
    assert (node.etag, node.size, node.superseded) == ("v2", 20, False)


def test_versioned_inodes_give_a_new_version_its_own_node():
    table = NodeTable(0.0, versioned=True)
    old = table.node_for("d/f", False, info("v1"), 1.0)
    old.lookups, old.opens = 1, 1                       # the kernel and a handle hold it
    new = table.node_for("d/f", False, info("v2", 20), 2.0)
    assert new.inode != old.inode and (new.etag, new.size) == ("v2", 20)
    assert old.superseded and (old.etag, old.size) == ("v1", 10)     # keeps its version
    assert table.at("d/f") is new and table.find(old.inode) is old
    assert table.node_for("d/f", False, info("v2", 20), 3.0) is new   # the same version: the same node
    table.forget(old.inode, 1)
    assert table.find(old.inode) is old                 # still open
    old.opens = 0
    table.forget(old.inode, 0)
    assert table.find(old.inode) is None


def test_new_version_supersedes_a_known_node_until_its_path_is_looked_up_again():
    table = NodeTable(0.0, versioned=True)
    node = table.node_for("d/f", False, info("v1"), 1.0)
    assert table.new_version(node, info("v1"), 2.0) is False and node.checked_at == 2.0   # unchanged: fresh
    assert table.new_version(node, info("v2"), 3.0) is True
    assert node.superseded and table.at("d/f") is None
    assert table.node_for("d/f", False, info("v2"), 4.0).inode != node.inode
