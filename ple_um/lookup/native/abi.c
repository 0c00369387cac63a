/* What rowcopy.py checks before it uses a library (rowcopy.h's structs are mirrored there in
 * ctypes): the version of the interface it was built for, and the digest of the source it was built
 * from. A library that lacks either, or reports another, is not used. */
#include "rowcopy.h"

/* Raised whenever a function that rowcopy.py declares, or a struct it mirrors, changes (a test
 * builds a library of another version by defining it). */
#ifndef PLE_ABI_VERSION
#define PLE_ABI_VERSION 6
#endif

#ifndef PLE_SOURCE_DIGEST
#define PLE_SOURCE_DIGEST "unknown" /* built by hand, outside native_build.py */
#endif

int64_t ple_abi_version(void) { return PLE_ABI_VERSION; }

const char *ple_source_digest(void) { return PLE_SOURCE_DIGEST; }
