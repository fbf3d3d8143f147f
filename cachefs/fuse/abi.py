"""The FUSE kernel protocol's numbers and structs, in one place (``linux/fuse.h``, protocol 7.x).

Every struct the session reads or writes is a precompiled ``struct.Struct`` here; every
constant has the kernel header's name without its ``FUSE_`` prefix. Nothing else in cachefs
spells a FUSE number.
"""

import struct

KERNEL_MAJOR = 7
#: the newest minor this layer knows; INIT answers min(this, the kernel's)
KERNEL_MINOR = 45
MIN_KERNEL_MINOR = 26          # Linux 4.16: max_pages, splice and readdirplus as used here

# --- opcodes ---------------------------------------------------------------------------------------
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS, RELEASE = 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18
FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE = 27, 28, 29, 30, 31, 32, 33, 34, 35
INTERRUPT, BMAP, DESTROY, IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE = 36, 37, 38, 39, 40, 41, 42, 43
READDIRPLUS, RENAME2, LSEEK, COPY_FILE_RANGE, SETUPMAPPING, REMOVEMAPPING, SYNCFS, TMPFILE, STATX = (
    44, 45, 46, 47, 48, 49, 50, 51, 52)

_OPCODES = ("LOOKUP FORGET GETATTR SETATTR READLINK SYMLINK MKNOD MKDIR UNLINK RMDIR RENAME LINK OPEN READ WRITE "
            "STATFS RELEASE FSYNC SETXATTR GETXATTR LISTXATTR REMOVEXATTR FLUSH INIT OPENDIR READDIR RELEASEDIR "
            "FSYNCDIR GETLK SETLK SETLKW ACCESS CREATE INTERRUPT BMAP DESTROY IOCTL POLL NOTIFY_REPLY BATCH_FORGET "
            "FALLOCATE READDIRPLUS RENAME2 LSEEK COPY_FILE_RANGE SETUPMAPPING REMOVEMAPPING SYNCFS TMPFILE STATX")
OPCODE_NAMES = {globals()[name]: name.lower() for name in _OPCODES.split()}

# --- INIT flags (flags: bits 0-31, flags2: bits 32-63 as one 64-bit set) -----------------------------
ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
SPLICE_WRITE = 1 << 7
SPLICE_MOVE = 1 << 8
SPLICE_READ = 1 << 9
FLOCK_LOCKS = 1 << 10
HAS_IOCTL_DIR = 1 << 11
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
POSIX_ACL = 1 << 20
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
EXPLICIT_INVAL_DATA = 1 << 25
MAP_ALIGNMENT = 1 << 26
SUBMOUNTS = 1 << 27
HANDLE_KILLPRIV_V2 = 1 << 28
SETXATTR_EXT = 1 << 29
INIT_EXT = 1 << 30
INIT_RESERVED = 1 << 31
SECURITY_CTX = 1 << 32
HAS_INODE_DAX = 1 << 33
CREATE_SUPP_GROUP = 1 << 34
HAS_EXPIRE_ONLY = 1 << 35
DIRECT_IO_ALLOW_MMAP = 1 << 36
PASSTHROUGH = 1 << 37
NO_EXPORT_SUPPORT = 1 << 38
HAS_RESEND = 1 << 39

_FLAG_NAMES = ("ASYNC_READ POSIX_LOCKS ATOMIC_O_TRUNC EXPORT_SUPPORT BIG_WRITES DONT_MASK SPLICE_WRITE "
               "SPLICE_MOVE SPLICE_READ FLOCK_LOCKS HAS_IOCTL_DIR AUTO_INVAL_DATA DO_READDIRPLUS READDIRPLUS_AUTO "
               "ASYNC_DIO WRITEBACK_CACHE NO_OPEN_SUPPORT PARALLEL_DIROPS HANDLE_KILLPRIV POSIX_ACL ABORT_ERROR "
               "MAX_PAGES CACHE_SYMLINKS NO_OPENDIR_SUPPORT EXPLICIT_INVAL_DATA MAP_ALIGNMENT SUBMOUNTS "
               "HANDLE_KILLPRIV_V2 SETXATTR_EXT INIT_EXT INIT_RESERVED SECURITY_CTX HAS_INODE_DAX "
               "CREATE_SUPP_GROUP HAS_EXPIRE_ONLY DIRECT_IO_ALLOW_MMAP PASSTHROUGH NO_EXPORT_SUPPORT HAS_RESEND")
INIT_FLAG_NAMES = {globals()[name]: name.lower() for name in _FLAG_NAMES.split()}


def flag_names(flags: int) -> str:
    """The INIT flags set in ``flags``, by name (for the log)."""
    return " ".join(name for bit, name in sorted(INIT_FLAG_NAMES.items()) if flags & bit) or "none"


# --- open reply flags ------------------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_STREAM = 1 << 4
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# --- setattr valid bits ----------------------------------------------------------------------------
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
FATTR_LOCKOWNER, FATTR_CTIME, FATTR_KILL_SUIDGID = 1 << 9, 1 << 10, 1 << 11

GETATTR_FH = 1 << 0
RELEASE_FLUSH = 1 << 0
WRITE_CACHE = 1 << 0

# --- notify codes (the error field of an unsolicited message, unique 0) ----------------------------
NOTIFY_POLL, NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY, NOTIFY_STORE = 1, 2, 3, 4
NOTIFY_RETRIEVE, NOTIFY_DELETE, NOTIFY_RESEND = 5, 6, 7

# --- ioctls on /dev/fuse ---------------------------------------------------------------------------
DEV_IOC_CLONE = 0x8004E500           # _IOR(229, 0, uint32_t): arg the session fd
DEV_IOC_BACKING_OPEN = 0x4010E501    # _IOW(229, 1, struct fuse_backing_map): returns the backing id
DEV_IOC_BACKING_CLOSE = 0x4004E502   # _IOW(229, 2, uint32_t)

# --- structs ---------------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")          # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, pad
OUT_HEADER = struct.Struct("<IiQ")               # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")        # ino size blocks atime mtime ctime *nsec mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("<QQQQII" + ATTR.format[1:])   # nodeid generation entry_valid attr_valid *_nsec attr
ATTR_OUT = struct.Struct("<QII" + ATTR.format[1:])       # attr_valid attr_valid_nsec dummy attr
GETATTR_IN = struct.Struct("<IIQ")               # getattr_flags dummy fh
FORGET_IN = struct.Struct("<Q")                  # nlookup
BATCH_FORGET_IN = struct.Struct("<II")           # count dummy
FORGET_ONE = struct.Struct("<QQ")                # nodeid nlookup
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # valid pad fh size lock_owner atime mtime ctime *nsec mode unused uid gid unused
MKNOD_IN = struct.Struct("<IIII")                # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")                  # mode umask
RENAME_IN = struct.Struct("<Q")                  # newdir
RENAME2_IN = struct.Struct("<QII")               # newdir flags padding
LINK_IN = struct.Struct("<Q")                    # oldnodeid
OPEN_IN = struct.Struct("<II")                   # flags open_flags
CREATE_IN = struct.Struct("<IIII")               # flags mode umask open_flags
OPEN_OUT = struct.Struct("<QIi")                 # fh open_flags backing_id
RELEASE_IN = struct.Struct("<QIIQ")              # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("<QIIQ")                # fh unused padding lock_owner
READ_IN = struct.Struct("<QQIIQII")              # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("<QQIIQII")             # fh offset size write_flags lock_owner flags padding
WRITE_OUT = struct.Struct("<II")                 # size padding
STATFS_OUT = struct.Struct("<QQQQQIIII24x")      # blocks bfree bavail files ffree bsize namelen frsize padding spare
FSYNC_IN = struct.Struct("<QII")                 # fh fsync_flags padding
GETXATTR_IN = struct.Struct("<II")               # size padding
GETXATTR_OUT = struct.Struct("<II")              # size padding
ACCESS_IN = struct.Struct("<II")                 # mask padding
INIT_IN_OLD = struct.Struct("<IIII")             # major minor max_readahead flags (before 7.36)
INIT_IN = struct.Struct("<IIIII44x")             # ... flags2 unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")     # major minor max_readahead flags max_background congestion
#                                                  max_write time_gran max_pages map_alignment flags2 max_stack_depth
INTERRUPT_IN = struct.Struct("<Q")               # unique
DIRENT = struct.Struct("<QQII")                  # ino off namelen type
IOCTL_IN = struct.Struct("<QIIQII")              # fh flags cmd arg in_size out_size
IOCTL_OUT = struct.Struct("<iIII")               # result flags in_iovs out_iovs
LSEEK_IN = struct.Struct("<QQII")                # fh offset whence padding
LSEEK_OUT = struct.Struct("<Q")
NOTIFY_STORE_OUT = struct.Struct("<QQII")        # nodeid offset size padding
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")   # ino off len
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")   # parent namelen flags
BACKING_MAP = struct.Struct("<iIQ")              # fd flags padding

#: the largest write the session accepts (and so the read buffer it needs, header included)
MAX_WRITE = 1 << 20
MAX_PAGES_VALUE = MAX_WRITE // 4096
BUFFER_SIZE = MAX_WRITE + 4096

assert IN_HEADER.size == 40 and OUT_HEADER.size == 16 and ATTR.size == 88
assert ENTRY_OUT.size == 128 and ATTR_OUT.size == 104 and SETATTR_IN.size == 88
assert OPEN_OUT.size == 16 and READ_IN.size == 40 and WRITE_IN.size == 40 and STATFS_OUT.size == 80
assert INIT_IN.size == 64 and INIT_OUT.size == 64 and BACKING_MAP.size == 16


def dirent_size(namelen: int, plus: bool) -> int:
    """Bytes one directory entry takes in a READDIR(PLUS) answer (8-byte aligned)."""
    size = DIRENT.size + namelen
    return (ENTRY_OUT.size if plus else 0) + ((size + 7) & ~7)
