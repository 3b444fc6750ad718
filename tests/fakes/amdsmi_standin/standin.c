/* A stand-in for ROCm's libamd_smi.so, loaded by AMD's unmodified `amdsmi` Python package.
 *
 * It answers the calls the dra-agent AMD backend makes as AMD's C sources do (each behaviour
 * cites the file and function it follows: amdsmi's src/amd_smi/amd_smi.cc, amd_smi_utils.cc,
 * amd_smi_drm.cc, and rocm-smi-lib's rocm_smi.cc, which amdsmi wraps). Every other symbol the
 * 7.0.2 wrapper binds at import is a stub answering AMDSMI_STATUS_NOT_SUPPORTED, generated at
 * build time from the wrapper (tests/fakes/amd_standin.py).
 *
 * The "hardware" is configured by text commands (`standin_command`, called through ctypes by
 * the tests, or read at load from $AMDSMI_STANDIN_COMMANDS, one per line, for agent processes).
 * A command is fields separated by '|': a verb, then key=value pairs. The hardware may change at
 * any time; what amdsmi caches at amdsmi_init (the handle list, PCI address, KFD and DRM ids)
 * changes only at the next amdsmi_shut_down + amdsmi_init, as in the real library.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* amdsmi_status_t (amdsmi.h) */
enum {
    ST_SUCCESS = 0, ST_INVAL = 1, ST_NOT_SUPPORTED = 2, ST_DRM_ERROR = 6, ST_FILE_ERROR = 14,
    ST_NOT_INIT = 32, ST_MORE_DATA = 39, ST_NO_DATA = 40, ST_INSUFFICIENT_SIZE = 41,
};
#define ST_UNKNOWN_ERROR 0xFFFFFFFFu

#define MAX_PROCS 128
#define MAX_CPER 64
#define MAX_PAGES 64
#define MAX_FAILS 16
#define MAX_EVENTS 256
#define NAME 256

typedef struct {
    uint32_t severity;
    uint64_t notify;
    int year, month, day, hour, minute, second;
    char id[9];
} cper_t;

typedef struct {
    uint64_t address, size;
    uint32_t status;
} page_t;

typedef struct {
    char function[80];
    uint32_t status;
} fail_t;

typedef struct {
    int used;
    uint64_t domain;
    unsigned bus, dev, func;
    unsigned card, render, kfd_node, partition_id, numa_node;
    char market[NAME], product[NAME], serial[NAME], driver[NAME], compute[32], memory[32];
    uint64_t device_id, gfx, vram_mb;
    unsigned cus;
    uint64_t ecc_mask;
    uint64_t ecc_ce[64], ecc_ue[64];
    page_t pages[MAX_PAGES];
    int npages;
    long long threshold; /* < 0: the debugfs file cannot be read (no root) */
    long long pcie_replay; /* < 0: not reported */
    uint32_t xgmi;
    unsigned activity, vram_used_mb, power;
    long long temp_hotspot, temp_edge; /* < -1000: no such sensor */
    cper_t cper[MAX_CPER];
    int ncper;
    int lost;
    fail_t fails[MAX_FAILS];
    int nfails;
    char unsupported[1024]; /* ",name,name," */
    uint64_t event_mask;
    int events_open;
} proc_t;

/* What amdsmi_init caches per processor (amd_smi.cc: AMDSmiGPUDevice::get_bdf, get_card_id,
 * get_drm_render_minor, filled by AMDSmiSystem::init -> populate_amd_gpu_devices). */
typedef struct {
    int proc;
    uint64_t domain;
    unsigned bus, dev, func, card, render, kfd_node, partition_id;
} snap_t;

typedef struct {
    int proc;
    uint32_t type;
    char message[256];
} event_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static proc_t procs[MAX_PROCS];
static int nprocs;
static snap_t snap[MAX_PROCS];
static int nsnap;
static int initialized;
static unsigned generation;
static event_t events[MAX_EVENTS];
static int nevents;
/* Behaviours (command "global"): */
static int cper_empty_file_error = 1; /* 7.0.x: FILE_ERROR on an empty ring; 0: fixed versions */
static int uuid_per_partition = 0;     /* 7.0.x: fcn = 0xff for every partition; 1: newer */
static uint32_t init_status = 0, events_status = 0, first_read_status = 0, read_status = 0;
static int first_read_pending = 0;
static uint32_t lib_major = 26, lib_minor = 0, lib_release = 2;
static char hang_function[80];
static int hang_released = 1;

/* Calls per function, for tests that count them. */
#define MAX_COUNTERS 96
static struct { char name[80]; uint64_t count; } counters[MAX_COUNTERS];
static int ncounters;

static void count_call(const char *name) {
    for (int i = 0; i < ncounters; i++)
        if (strcmp(counters[i].name, name) == 0) { counters[i].count++; return; }
    if (ncounters < MAX_COUNTERS) {
        snprintf(counters[ncounters].name, sizeof counters[ncounters].name, "%s", name);
        counters[ncounters++].count = 1;
    }
}

/* A test may make one function block until "release" (a wedged driver). Called with `lock`. */
static void maybe_hang(const char *name) {
    while (!hang_released && strcmp(hang_function, name) == 0) pthread_cond_wait(&changed, &lock);
}

/* ---- handles ----------------------------------------------------------------------------- */

#define HANDLE_BASE 0x5000u
#define SOCKET_BASE 0x700000u

static void *handle_of(int s) {
    return (void *)(uintptr_t)(HANDLE_BASE + (uintptr_t)generation * 0x10000u + (uintptr_t)s * 0x10u);
}

/* amd_smi.cc get_gpu_device_from_handle: AMDSMI_CHECK_INIT first (NOT_INIT), then a handle the
 * system does not hold (one from before amdsmi_shut_down) is AMDSMI_STATUS_INVAL. */
static uint32_t lookup(void *handle, const char *name, proc_t **out, snap_t **cached) {
    count_call(name);
    if (!initialized) return ST_NOT_INIT;
    uintptr_t v = (uintptr_t)handle;
    if (v < HANDLE_BASE) return ST_INVAL;
    v -= HANDLE_BASE;
    if (v / 0x10000u != generation || (v % 0x10000u) % 0x10u) return ST_INVAL;
    uintptr_t s = (v % 0x10000u) / 0x10u;
    if (s >= (uintptr_t)nsnap) return ST_INVAL;
    proc_t *p = &procs[snap[s].proc];
    *out = p;
    if (cached) *cached = &snap[s];
    maybe_hang(name);
    for (int i = 0; i < p->nfails; i++)
        if (strcmp(p->fails[i].function, name) == 0) return p->fails[i].status;
    char key[100];
    snprintf(key, sizeof key, ",%s,", name);
    if (strstr(p->unsupported, key)) return ST_NOT_SUPPORTED;
    return ST_SUCCESS;
}

#define BEGIN(name)                                                \
    proc_t *p;                                                     \
    snap_t *c;                                                     \
    pthread_mutex_lock(&lock);                                     \
    uint32_t st = lookup(handle, name, &p, &c);                    \
    (void)c;                                                       \
    if (st != ST_SUCCESS) { pthread_mutex_unlock(&lock); return st; }
#define END(status) do { pthread_mutex_unlock(&lock); return (status); } while (0)

/* A lost GPU: calls through the DRM ioctl fail (amd_smi_drm.cc AMDSmiDrm::amdgpu_query_info:
 * `if (status == 0) return AMDSMI_STATUS_SUCCESS; return AMDSMI_STATUS_DRM_ERROR;`), calls that
 * read the device's sysfs files get an errno rocm_smi.cc ErrnoToRsmiStatus maps to
 * RSMI_STATUS_UNKNOWN_ERROR (ENODEV), and what amdsmi_init cached still answers. */
#define IOCTL_CALL() do { if (p->lost) END(ST_DRM_ERROR); } while (0)
#define SYSFS_CALL() do { if (p->lost) END(ST_UNKNOWN_ERROR); } while (0)

/* ---- library ----------------------------------------------------------------------------- */

static int gpu_key_equal(const proc_t *a, const proc_t *b) {
    return a->domain == b->domain && a->bus == b->bus && a->dev == b->dev;
}

/* amd_smi.cc amdsmi_init: `if (initialized_lib) return AMDSMI_STATUS_SUCCESS;` (not counted);
 * AMDSmiSystem::init builds the processor list once (amd_smi_system.cc populate_amd_gpu_devices). */
uint32_t amdsmi_init(uint64_t flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    count_call("amdsmi_init");
    if (init_status) END(init_status);
    if (initialized) END(ST_SUCCESS);
    generation++;
    nsnap = 0;
    /* Processors of one GPU are listed together (one socket per GPU), partitions in order. */
    for (int i = 0; i < nprocs; i++) {
        if (!procs[i].used) continue;
        int seen = 0;
        for (int k = 0; k < nsnap; k++) seen |= gpu_key_equal(&procs[snap[k].proc], &procs[i]);
        if (seen) continue;
        for (int j = i; j < nprocs; j++) {
            proc_t *q = &procs[j];
            if (!q->used || !gpu_key_equal(q, &procs[i])) continue;
            snap[nsnap++] = (snap_t){j, q->domain, q->bus, q->dev, q->func, q->card, q->render,
                                     q->kfd_node, q->partition_id};
        }
    }
    initialized = 1;
    first_read_pending = 1;
    END(ST_SUCCESS);
}

/* amd_smi.cc amdsmi_shut_down: tears the whole process's library down (not reference-counted);
 * the KFD event fds close with it (rocm_smi.cc rsmi_shut_down). */
uint32_t amdsmi_shut_down(void) {
    pthread_mutex_lock(&lock);
    count_call("amdsmi_shut_down");
    maybe_hang("amdsmi_shut_down");
    if (!initialized) END(ST_NOT_INIT);
    initialized = 0;
    for (int i = 0; i < nprocs; i++) { procs[i].event_mask = 0; procs[i].events_open = 0; }
    pthread_cond_broadcast(&changed);
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint32_t major, minor, release;
    uint8_t pad[4];
    const char *build;
} version_t;

uint32_t amdsmi_get_lib_version(version_t *version) {
    static const char build[] = "standin";
    pthread_mutex_lock(&lock);
    count_call("amdsmi_get_lib_version");
    version->major = lib_major;
    version->minor = lib_minor;
    version->release = lib_release;
    version->build = build;
    END(ST_SUCCESS);
}

static int sockets(int first_of[MAX_PROCS]) {
    int n = 0;
    for (int s = 0; s < nsnap; s++)
        if (s == 0 || !gpu_key_equal(&procs[snap[s].proc], &procs[snap[s - 1].proc])) first_of[n++] = s;
    return n;
}

/* amd_smi.cc amdsmi_get_socket_handles / amdsmi_get_processor_handles: a null array asks for
 * the count; otherwise up to *count handles are copied from the list built at amdsmi_init. */
uint32_t amdsmi_get_socket_handles(uint32_t *count, void **handles) {
    pthread_mutex_lock(&lock);
    count_call("amdsmi_get_socket_handles");
    if (!initialized) END(ST_NOT_INIT);
    int first[MAX_PROCS];
    int n = sockets(first);
    if (handles == NULL) { *count = (uint32_t)n; END(ST_SUCCESS); }
    uint32_t k = *count < (uint32_t)n ? *count : (uint32_t)n;
    for (uint32_t i = 0; i < k; i++)
        handles[i] = (void *)(uintptr_t)(SOCKET_BASE + generation * 0x1000u + i * 0x10u);
    *count = k;
    END(ST_SUCCESS);
}

uint32_t amdsmi_get_processor_handles(void *socket, uint32_t *count, void **handles) {
    pthread_mutex_lock(&lock);
    count_call("amdsmi_get_processor_handles");
    if (!initialized) END(ST_NOT_INIT);
    int first[MAX_PROCS];
    int n = sockets(first);
    uintptr_t v = (uintptr_t)socket - SOCKET_BASE - generation * 0x1000u;
    if ((uintptr_t)socket < SOCKET_BASE || v % 0x10u || v / 0x10u >= (uintptr_t)n) END(ST_INVAL);
    int s = (int)(v / 0x10u);
    int begin = first[s], end = s + 1 < n ? first[s + 1] : nsnap;
    if (handles == NULL) { *count = (uint32_t)(end - begin); END(ST_SUCCESS); }
    uint32_t k = 0;
    for (int i = begin; i < end && k < *count; i++) handles[k++] = handle_of(i);
    *count = k;
    END(ST_SUCCESS);
}

/* ---- identity (cached at amdsmi_init) ---------------------------------------------------- */

/* amd_smi.cc amdsmi_get_gpu_device_bdf: `*bdf = gpu_device->get_bdf();` (cached; never lost). */
uint32_t amdsmi_get_gpu_device_bdf(void *handle, uint64_t *bdf) {
    BEGIN("amdsmi_get_gpu_device_bdf");
    *bdf = (c->func & 0x7) | ((uint64_t)(c->dev & 0x1f) << 3) | ((uint64_t)(c->bus & 0xff) << 8) |
           (c->domain << 16);
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint64_t kfd_id;
    uint32_t node_id, current_partition_id, reserved[12];
} kfd_info_t;

/* amd_smi.cc amdsmi_get_gpu_kfd_info: KFD ids from the topology read at init; always SUCCESS. */
uint32_t amdsmi_get_gpu_kfd_info(void *handle, kfd_info_t *info) {
    BEGIN("amdsmi_get_gpu_kfd_info");
    memset(info, 0, sizeof *info);
    info->kfd_id = 0x9000 + c->kfd_node;
    info->node_id = c->kfd_node;
    info->current_partition_id = c->partition_id;
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint32_t drm_render, drm_card, hsa_id, hip_id;
    char hip_uuid[256];
} enumeration_info_t;

/* amd_smi.cc amdsmi_get_gpu_enumeration_info: `info->drm_card = gpu_device->get_card_id();
 * info->drm_render = gpu_device->get_drm_render_minor();` (cached). */
uint32_t amdsmi_get_gpu_enumeration_info(void *handle, enumeration_info_t *info) {
    BEGIN("amdsmi_get_gpu_enumeration_info");
    memset(info, 0, sizeof *info);
    info->drm_render = c->render;
    info->drm_card = c->card;
    info->hsa_id = c->kfd_node;
    info->hip_id = (uint32_t)(c - snap);
    snprintf(info->hip_uuid, sizeof info->hip_uuid, "GPU-%s", p->serial);
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    char market_name[256];
    uint32_t vendor_id;
    char vendor_name[256];
    uint32_t subvendor_id;
    uint64_t device_id;
    uint32_t rev_id;
    char asic_serial[256];
    uint32_t oam_id, num_of_compute_units;
    uint8_t pad[4];
    uint64_t target_graphics_version;
    uint32_t subsystem_id, reserved[21];
} asic_info_t;

/* amd_smi.cc amdsmi_get_gpu_asic_info: the DRM ioctl AMDGPU_INFO_DEV_INFO (DRM_ERROR when the GPU
 * is gone), the serial as a hex string (the wrapper parses it with int(..., 16)). */
uint32_t amdsmi_get_gpu_asic_info(void *handle, asic_info_t *info) {
    BEGIN("amdsmi_get_gpu_asic_info");
    IOCTL_CALL();
    memset(info, 0, sizeof *info);
    snprintf(info->market_name, sizeof info->market_name, "%s", p->market);
    info->vendor_id = 0x1002;
    snprintf(info->vendor_name, sizeof info->vendor_name, "Advanced Micro Devices Inc. [AMD/ATI]");
    info->subvendor_id = 0x1002;
    info->device_id = p->device_id;
    snprintf(info->asic_serial, sizeof info->asic_serial, "%s", p->serial);
    info->oam_id = 0xFFFFFFFF;
    info->num_of_compute_units = p->cus ? p->cus : 0xFFFFFFFF;
    info->target_graphics_version = p->gfx;
    info->subsystem_id = (uint32_t)p->device_id;
    END(ST_SUCCESS);
}

/* amd_smi.cc amdsmi_get_gpu_device_uuid: asic_info first (so DRM_ERROR when lost), then
 * amdsmi_uuid_gen(uuid, strtoull(asic_serial, nullptr, 16), device_id, fcn) with
 * `const uint8_t fcn = 0xff;` in 7.0.x: every partition of a GPU gets the GPU's UUID. Newer
 * versions generate it "with partition index" (uuid_per_partition). The layout below is ours. */
static void make_uuid(const proc_t *p, unsigned partition, char *out, size_t size) {
    uint64_t serial = strtoull(p->serial, NULL, 16);
    unsigned fcn = uuid_per_partition ? partition : 0xff;
    snprintf(out, size, "%02x%02x%04x-%04x-1000-8000-%012llx", (unsigned)(serial >> 56) & 0xff, fcn,
             (unsigned)p->device_id & 0xffff, (unsigned)(serial >> 40) & 0xffff,
             (unsigned long long)(serial & 0xffffffffffffULL));
}

uint32_t amdsmi_get_gpu_device_uuid(void *handle, uint32_t *length, char *uuid) {
    BEGIN("amdsmi_get_gpu_device_uuid");
    IOCTL_CALL();
    if (*length < 37) END(ST_INSUFFICIENT_SIZE);
    make_uuid(p, c->partition_id, uuid, *length);
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    char model_number[256], product_serial[256], fru_id[256], product_name[256], manufacturer[256];
    uint64_t reserved[64];
} board_info_t;

/* amd_smi.cc amdsmi_get_gpu_board_info: FRU strings from sysfs (empty when absent). */
uint32_t amdsmi_get_gpu_board_info(void *handle, board_info_t *info) {
    BEGIN("amdsmi_get_gpu_board_info");
    SYSFS_CALL();
    memset(info, 0, sizeof *info);
    snprintf(info->product_name, sizeof info->product_name, "%s", p->product);
    snprintf(info->manufacturer, sizeof info->manufacturer, "AMD");
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    char version[256], date[256], name[256];
} driver_info_t;

/* amd_smi_utils.cc smi_amdgpu_get_driver_version: /sys/module/amdgpu/version, and without it
 * (in-box amdgpu) the kernel release token of /proc/version ("inbox" below does just that). */
uint32_t amdsmi_get_gpu_driver_info(void *handle, driver_info_t *info) {
    BEGIN("amdsmi_get_gpu_driver_info");
    memset(info, 0, sizeof *info);
    snprintf(info->name, sizeof info->name, "amdgpu");
    if (strcmp(p->driver, "inbox") == 0) {
        FILE *f = fopen("/proc/version", "r");
        char a[64] = "", b[64] = "", release[128] = "";
        if (f) {
            if (fscanf(f, "%63s %63s %127s", a, b, release) != 3) release[0] = 0;
            fclose(f);
        }
        snprintf(info->version, sizeof info->version, "%s", release);
    } else {
        snprintf(info->version, sizeof info->version, "%s", p->driver);
    }
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint32_t type;
    char vendor[256];
    uint8_t pad0[4];
    uint64_t size_mb;
    uint32_t bit_width;
    uint8_t pad1[4];
    uint64_t max_bandwidth, reserved[37];
} vram_info_t;

/* amd_smi.cc amdsmi_get_gpu_vram_info: AMDGPU_INFO_VRAM_GTT ioctl; `vram_size = total / (1024 * 1024)`. */
uint32_t amdsmi_get_gpu_vram_info(void *handle, vram_info_t *info) {
    BEGIN("amdsmi_get_gpu_vram_info");
    IOCTL_CALL();
    memset(info, 0, sizeof *info);
    info->type = 3;
    snprintf(info->vendor, sizeof info->vendor, "HYNIX");
    info->size_mb = p->vram_mb;
    info->bit_width = 8192;
    info->max_bandwidth = UINT64_MAX;
    END(ST_SUCCESS);
}

/* rocm_smi_utils.cc: a sysfs file that does not exist (a GPU without partition modes) is
 * RSMI_STATUS_NOT_SUPPORTED; the string is copied up to the caller's length. */
static uint32_t partition_string(proc_t *p, const char *value, char *out, uint32_t length) {
    if (p->lost) return ST_UNKNOWN_ERROR;
    if (!value[0]) return ST_NOT_SUPPORTED;
    if (length == 0) return ST_INVAL;
    snprintf(out, length, "%s", value);
    return strlen(value) >= length ? ST_INSUFFICIENT_SIZE : ST_SUCCESS;
}

uint32_t amdsmi_get_gpu_compute_partition(void *handle, char *out, uint32_t length) {
    BEGIN("amdsmi_get_gpu_compute_partition");
    END(partition_string(p, p->compute, out, length));
}

uint32_t amdsmi_get_gpu_memory_partition(void *handle, char *out, uint32_t length) {
    BEGIN("amdsmi_get_gpu_memory_partition");
    END(partition_string(p, p->memory, out, length));
}

/* amd_smi.cc amdsmi_topo_get_numa_node_number: the KFD topology's CPU node (read at init). */
uint32_t amdsmi_topo_get_numa_node_number(void *handle, uint32_t *node) {
    BEGIN("amdsmi_topo_get_numa_node_number");
    *node = p->numa_node;
    END(ST_SUCCESS);
}

/* ---- telemetry -------------------------------------------------------------------------- */

typedef struct __attribute__((packed)) {
    uint32_t gfx, umc, mm, reserved[13];
} engine_usage_t;

/* amd_smi.cc amdsmi_get_gpu_activity: gpu_metrics from sysfs; 0xFFFF where not reported. */
uint32_t amdsmi_get_gpu_activity(void *handle, engine_usage_t *usage) {
    BEGIN("amdsmi_get_gpu_activity");
    SYSFS_CALL();
    memset(usage, 0, sizeof *usage);
    usage->gfx = p->activity;
    usage->umc = usage->mm = 0xFFFF;
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint32_t total, used, reserved[2];
} vram_usage_t;

/* amd_smi.cc amdsmi_get_gpu_vram_usage: AMDGPU_INFO_VRAM_GTT / VRAM_USAGE ioctls, in MiB. */
uint32_t amdsmi_get_gpu_vram_usage(void *handle, vram_usage_t *usage) {
    BEGIN("amdsmi_get_gpu_vram_usage");
    IOCTL_CALL();
    memset(usage, 0, sizeof *usage);
    usage->total = (uint32_t)p->vram_mb;
    usage->used = p->vram_used_mb;
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint64_t socket_power;
    uint32_t current_socket_power, average_socket_power;
    uint64_t gfx_voltage, soc_voltage, mem_voltage;
    uint32_t power_limit;
    uint8_t pad[4];
    uint64_t reserved[18];
} power_info_t;

/* amd_smi.cc amdsmi_get_power_info: preset to 0xFFFF, filled from gpu_metrics (W). */
uint32_t amdsmi_get_power_info(void *handle, power_info_t *info) {
    BEGIN("amdsmi_get_power_info");
    SYSFS_CALL();
    memset(info, 0, sizeof *info);
    info->socket_power = p->power;
    info->current_socket_power = p->power;
    info->average_socket_power = 0xFFFF;
    info->gfx_voltage = info->soc_voltage = info->mem_voltage = 0xFFFF;
    info->power_limit = 750;
    END(ST_SUCCESS);
}

/* rocm_smi.cc rsmi_dev_temp_metric_get via amd_smi.cc amdsmi_get_temp_metric: millidegrees / 1000;
 * a sensor the board lacks (its hwmon file is missing) is NOT_SUPPORTED. */
uint32_t amdsmi_get_temp_metric(void *handle, uint32_t type, uint32_t metric, int64_t *value) {
    BEGIN("amdsmi_get_temp_metric");
    SYSFS_CALL();
    long long v = type == 0 ? p->temp_edge : type == 1 ? p->temp_hotspot : -100000;
    if (metric != 0 || v < -1000) END(ST_NOT_SUPPORTED);
    *value = v;
    END(ST_SUCCESS);
}

/* ---- RAS --------------------------------------------------------------------------------- */

/* rocm_smi.cc rsmi_dev_ecc_enabled_get: the ras/features mask from sysfs. */
uint32_t amdsmi_get_gpu_ecc_enabled(void *handle, uint64_t *mask) {
    BEGIN("amdsmi_get_gpu_ecc_enabled");
    SYSFS_CALL();
    *mask = p->ecc_mask;
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint64_t correctable, uncorrectable, deferred, reserved[5];
} error_count_t;

static int block_index(uint64_t block) {
    for (int i = 0; i < 64; i++)
        if (block == (1ULL << i)) return i;
    return -1;
}

/* rocm_smi.cc rsmi_dev_ecc_count_get: the block's ras/<block>_err_count file; a block without
 * one is NOT_SUPPORTED (FILE_ERROR mapped to it, rocm_smi.cc:705-723). */
uint32_t amdsmi_get_gpu_ecc_count(void *handle, uint64_t block, error_count_t *count) {
    BEGIN("amdsmi_get_gpu_ecc_count");
    SYSFS_CALL();
    int i = block_index(block);
    if (i < 0 || !(p->ecc_mask & block)) END(ST_NOT_SUPPORTED);
    memset(count, 0, sizeof *count);
    count->correctable = p->ecc_ce[i];
    count->uncorrectable = p->ecc_ue[i];
    END(ST_SUCCESS);
}

/* amd_smi.cc amdsmi_get_gpu_total_ecc_count: the sums over the enabled blocks. */
uint32_t amdsmi_get_gpu_total_ecc_count(void *handle, error_count_t *count) {
    BEGIN("amdsmi_get_gpu_total_ecc_count");
    SYSFS_CALL();
    memset(count, 0, sizeof *count);
    for (int i = 0; i < 64; i++)
        if (p->ecc_mask & (1ULL << i)) {
            count->correctable += p->ecc_ce[i];
            count->uncorrectable += p->ecc_ue[i];
        }
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint64_t address, size;
    uint32_t status;
    uint8_t pad[4];
} page_record_t;

/* rocm_smi.cc rsmi_dev_memory_reserved_pages_get: a null array asks for the count. */
uint32_t amdsmi_get_gpu_bad_page_info(void *handle, uint32_t *count, page_record_t *records) {
    BEGIN("amdsmi_get_gpu_bad_page_info");
    SYSFS_CALL();
    if (records == NULL) { *count = (uint32_t)p->npages; END(ST_SUCCESS); }
    uint32_t k = *count < (uint32_t)p->npages ? *count : (uint32_t)p->npages;
    for (uint32_t i = 0; i < k; i++) {
        memset(&records[i], 0, sizeof records[i]);
        records[i].address = p->pages[i].address;
        records[i].size = p->pages[i].size;
        records[i].status = p->pages[i].status;
    }
    *count = k;
    END(ST_SUCCESS);
}

/* amd_smi_utils.cc smi_amdgpu_get_bad_page_threshold: debugfs ras/bad_page_cnt_threshold,
 * `if (fs.fail()) return AMDSMI_STATUS_NOT_SUPPORTED;` (root only). */
uint32_t amdsmi_get_gpu_bad_page_threshold(void *handle, uint32_t *threshold) {
    BEGIN("amdsmi_get_gpu_bad_page_threshold");
    SYSFS_CALL();
    if (p->threshold < 0) END(ST_NOT_SUPPORTED);
    *threshold = (uint32_t)p->threshold;
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    uint16_t max_width;
    uint8_t pad0[2];
    uint32_t max_speed, version, slot_type, max_version;
    uint8_t pad1[4];
    uint64_t reserved[9];
    uint16_t width;
    uint8_t pad2[2];
    uint32_t speed, bandwidth;
    uint8_t pad3[4];
    uint64_t replay_count, l0_to_recovery, replay_roll_over, nak_sent, nak_received;
    uint32_t other_end_recovery;
    uint8_t pad4[4];
    uint64_t reserved2[12];
    uint64_t reserved3[32];
} pcie_info_t;

/* amd_smi.cc amdsmi_get_pcie_info: replay count from gpu_metrics or pcie_replay_count (sysfs);
 * UINT64_MAX where not reported. */
uint32_t amdsmi_get_pcie_info(void *handle, pcie_info_t *info) {
    BEGIN("amdsmi_get_pcie_info");
    SYSFS_CALL();
    memset(info, 0, sizeof *info);
    info->max_width = info->width = 16;
    info->max_speed = info->speed = 32000;
    info->version = info->max_version = 5;
    info->slot_type = 1;
    info->bandwidth = 0xFFFFFFFF;
    info->replay_count = p->pcie_replay < 0 ? UINT64_MAX : (uint64_t)p->pcie_replay;
    info->other_end_recovery = 0xFFFFFFFF;
    END(ST_SUCCESS);
}

/* rocm_smi.cc rsmi_dev_xgmi_error_status: xgmi_error sysfs, 0 none, 1 one, 2 several. */
uint32_t amdsmi_gpu_xgmi_error_status(void *handle, uint32_t *status) {
    BEGIN("amdsmi_gpu_xgmi_error_status");
    SYSFS_CALL();
    *status = p->xgmi;
    END(ST_SUCCESS);
}

#ifndef STANDIN_WITHOUT_CPER
typedef struct __attribute__((packed)) {
    char signature[4];
    uint16_t revision;
    uint32_t signature_end;
    uint16_t sec_cnt;
    uint32_t error_severity, valid_bits, record_length;
    uint8_t seconds, minutes, hours, flag, day, month, year, century;
    char platform_id[16];
    uint8_t partition_id[16];
    char creator_id[16];
    uint8_t notify_type[16];
    char record_id[8];
    uint32_t flags;
    uint64_t persistence_info;
    uint8_t reserved[12];
} cper_hdr_t;

#define CPER_RECORD_LENGTH 256

/* amd_smi.cc amdsmi_get_gpu_cper_entries over amd_smi_utils.cc amdsmi_read_cper_file (the
 * debugfs ring amdgpu_ring_cper): records whose (1 << severity) is in the mask are copied into
 * the buffer, their headers into `hdrs`, at most *count per call (MORE_DATA when more remain);
 * the cursor counts the matching records already returned. In 7.0.x the context's status starts
 * as AMDSMI_STATUS_FILE_ERROR and an empty ring (`bytes_read <= 0`) returns it: AMD SMI 26.5.0's
 * changelog lists the fix ("failing with AMDSMI_STATUS_FILE_ERROR on an empty CPER ring"). */
uint32_t amdsmi_get_gpu_cper_entries(void *handle, uint32_t severity_mask, char *buffer,
                                     uint64_t *buffer_size, cper_hdr_t **hdrs, uint64_t *count,
                                     uint64_t *cursor) {
    BEGIN("amdsmi_get_gpu_cper_entries");
    SYSFS_CALL();
    if (p->ncper == 0) {
        *count = 0;
        END(cper_empty_file_error ? ST_FILE_ERROR : ST_SUCCESS);
    }
    uint64_t matching = 0, copied = 0, offset = 0;
    uint32_t status = ST_SUCCESS;
    for (int i = 0; i < p->ncper; i++) {
        cper_t *r = &p->cper[i];
        if (!((1u << r->severity) & severity_mask)) continue;
        if (matching++ < *cursor) continue;
        if (copied == *count || offset + CPER_RECORD_LENGTH > *buffer_size) { status = ST_MORE_DATA; break; }
        cper_hdr_t *h = (cper_hdr_t *)(buffer + offset);
        memset(buffer + offset, 0, CPER_RECORD_LENGTH);
        memcpy(h->signature, "CPER", 4);
        h->revision = 0x100;
        h->signature_end = 0xFFFFFFFF;
        h->sec_cnt = 1;
        h->error_severity = r->severity;
        h->valid_bits = 0x3;
        h->record_length = CPER_RECORD_LENGTH;
        h->seconds = (uint8_t)r->second; h->minutes = (uint8_t)r->minute; h->hours = (uint8_t)r->hour;
        h->day = (uint8_t)r->day; h->month = (uint8_t)r->month;
        h->year = (uint8_t)(r->year % 100); h->century = (uint8_t)(r->year / 100);
        for (int b = 0; b < 8; b++) h->notify_type[b] = (uint8_t)(r->notify >> (8 * b));
        memcpy(h->record_id, r->id, strnlen(r->id, 8));
        hdrs[copied++] = h;
        offset += CPER_RECORD_LENGTH;
    }
    *cursor += copied;
    *count = copied;
    *buffer_size = offset;
    END(status);
}
#endif

/* ---- events ------------------------------------------------------------------------------ */

/* rocm_smi.cc rsmi_event_notification_init: opens the KFD event fd of the device. */
uint32_t amdsmi_init_gpu_event_notification(void *handle) {
    BEGIN("amdsmi_init_gpu_event_notification");
    if (events_status) END(events_status);
    if (p->lost) END(ST_UNKNOWN_ERROR);
    p->events_open = 1;
    END(ST_SUCCESS);
}

uint32_t amdsmi_set_gpu_event_notification_mask(void *handle, uint64_t mask) {
    BEGIN("amdsmi_set_gpu_event_notification_mask");
    if (!p->events_open) END(ST_INVAL);
    p->event_mask = mask;
    END(ST_SUCCESS);
}

uint32_t amdsmi_stop_gpu_event_notification(void *handle) {
    BEGIN("amdsmi_stop_gpu_event_notification");
    p->events_open = 0;
    p->event_mask = 0;
    END(ST_SUCCESS);
}

typedef struct __attribute__((packed)) {
    void *processor_handle;
    uint32_t event;
    char message[256];
    uint8_t pad[4];
} event_data_t;

static int snap_of(int proc) {
    for (int s = 0; s < nsnap; s++)
        if (snap[s].proc == proc) return s;
    return -1;
}

/* rocm_smi.cc rsmi_event_notification_get: polls every opened event fd for up to `timeout_ms`;
 * `if (*num_elem == 0) { return RSMI_STATUS_NO_DATA; }` (AMDSMI_STATUS_NO_DATA, 40) when none
 * came. Its first fill_data_buffer(false) returns ErrnoToRsmiStatus(errno) when errno is not
 * EAGAIN, and that errno can be stale: `first_read_status` answers it once after amdsmi_init. */
uint32_t amdsmi_get_gpu_event_notification(int timeout_ms, uint32_t *num_elem, event_data_t *data) {
    pthread_mutex_lock(&lock);
    count_call("amdsmi_get_gpu_event_notification");
    if (!initialized) END(ST_NOT_INIT);
    if (read_status) END(read_status);
    if (first_read_pending && first_read_status && nevents == 0) {
        first_read_pending = 0;
        END(first_read_status);
    }
    first_read_pending = 0;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec++; deadline.tv_nsec -= 1000000000L; }
    uint32_t k = 0;
    for (;;) {
        int keep = 0;
        for (int i = 0; i < nevents; i++) {
            event_t *e = &events[i];
            proc_t *p = &procs[e->proc];
            int s = snap_of(e->proc);
            int wanted = s >= 0 && p->events_open && e->type >= 1 && (p->event_mask & (1ULL << (e->type - 1)));
            if (wanted && k < *num_elem) {
                memset(&data[k], 0, sizeof data[k]);
                data[k].processor_handle = handle_of(s);
                data[k].event = e->type;
                snprintf(data[k].message, sizeof data[k].message, "%s", e->message);
                k++;
            } else if (!wanted && s >= 0 && p->events_open) {
                continue; /* not subscribed: the driver never queues it */
            } else {
                events[keep++] = *e;
            }
        }
        nevents = keep;
        if (k > 0 || !initialized) break;
        if (pthread_cond_timedwait(&changed, &lock, &deadline) == ETIMEDOUT) break;
    }
    *num_elem = k;
    if (k == 0) END(initialized ? ST_NO_DATA : ST_NOT_INIT);
    END(ST_SUCCESS);
}

/* ---- configuration ----------------------------------------------------------------------- */

static void set_processor(proc_t *p, const char *key, const char *v) {
    if (!strcmp(key, "bdf")) {
        unsigned long long domain = 0;
        if (sscanf(v, "%llx:%x:%x.%x", &domain, &p->bus, &p->dev, &p->func) == 4) p->domain = domain;
    } else if (!strcmp(key, "card")) p->card = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "render")) p->render = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "kfd")) p->kfd_node = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "partition")) p->partition_id = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "numa")) p->numa_node = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "market")) snprintf(p->market, NAME, "%s", v);
    else if (!strcmp(key, "product")) snprintf(p->product, NAME, "%s", v);
    else if (!strcmp(key, "serial")) snprintf(p->serial, NAME, "%s", v);
    else if (!strcmp(key, "driver")) snprintf(p->driver, NAME, "%s", v);
    else if (!strcmp(key, "compute")) snprintf(p->compute, sizeof p->compute, "%s", v);
    else if (!strcmp(key, "memory")) snprintf(p->memory, sizeof p->memory, "%s", v);
    else if (!strcmp(key, "device_id")) p->device_id = strtoull(v, NULL, 0);
    else if (!strcmp(key, "gfx")) p->gfx = strtoull(v, NULL, 16);
    else if (!strcmp(key, "vram_mb")) p->vram_mb = strtoull(v, NULL, 0);
    else if (!strcmp(key, "cus")) p->cus = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "ecc_mask")) p->ecc_mask = strtoull(v, NULL, 0);
    else if (!strcmp(key, "threshold")) p->threshold = strtoll(v, NULL, 0);
    else if (!strcmp(key, "pcie_replay")) p->pcie_replay = strtoll(v, NULL, 0);
    else if (!strcmp(key, "xgmi")) p->xgmi = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(key, "activity")) p->activity = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "vram_used")) p->vram_used_mb = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "power")) p->power = (unsigned)strtoul(v, NULL, 0);
    else if (!strcmp(key, "temp_hotspot")) p->temp_hotspot = strtoll(v, NULL, 0);
    else if (!strcmp(key, "temp_edge")) p->temp_edge = strtoll(v, NULL, 0);
    else if (!strcmp(key, "lost")) p->lost = atoi(v);
    else if (!strcmp(key, "unsupported")) snprintf(p->unsupported, sizeof p->unsupported, ",%s,", v);
}

static void set_global(const char *key, const char *v) {
    if (!strcmp(key, "cper_empty_file_error")) cper_empty_file_error = atoi(v);
    else if (!strcmp(key, "uuid_per_partition")) uuid_per_partition = atoi(v);
    else if (!strcmp(key, "init_status")) init_status = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(key, "events_status")) events_status = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(key, "first_read_status")) first_read_status = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(key, "read_status")) read_status = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(key, "lib_version"))
        sscanf(v, "%u.%u.%u", &lib_major, &lib_minor, &lib_release);
    else if (!strcmp(key, "hang")) { snprintf(hang_function, sizeof hang_function, "%s", v); hang_released = 0; }
}

static void reset_all(void) {
    memset(procs, 0, sizeof procs);
    nprocs = 0;
    nevents = 0;
    nsnap = 0;
    initialized = 0;
    ncounters = 0;
    cper_empty_file_error = 1;
    uuid_per_partition = 0;
    init_status = events_status = first_read_status = read_status = 0;
    lib_major = 26; lib_minor = 0; lib_release = 2;
    hang_released = 1;
}

static void fill_defaults(proc_t *p) {
    memset(p, 0, sizeof *p);
    p->used = 1;
    p->threshold = -1;
    p->temp_hotspot = p->temp_edge = -100000;
}

/* Runs one command; returns the processor index for "gpu", 0 on success, -1 on a bad command. */
int standin_command(const char *line) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", line);
    char *fields[64];
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, "|", &save); t && n < 64; t = strtok_r(NULL, "|", &save))
        fields[n++] = t;
    if (n == 0) return -1;
    int result = 0;
    pthread_mutex_lock(&lock);
    const char *verb = fields[0];
    int first = 1;
    proc_t *p = NULL;
    if (!strcmp(verb, "reset")) {
        reset_all();
    } else if (!strcmp(verb, "gpu")) {
        if (nprocs == MAX_PROCS) { result = -1; goto out; }
        p = &procs[nprocs];
        fill_defaults(p);
        result = nprocs++;
    } else if (!strcmp(verb, "global")) {
        for (int i = 1; i < n; i++) {
            char *eq = strchr(fields[i], '=');
            if (eq) { *eq = 0; set_global(fields[i], eq + 1); }
        }
        goto out;
    } else if (!strcmp(verb, "release")) {
        hang_released = 1;
        goto out;
    } else if (n >= 2) {
        int i = atoi(fields[1]);
        if (i < 0 || i >= nprocs) { result = -1; goto out; }
        p = &procs[i];
        first = 2;
        if (!strcmp(verb, "remove")) { p->used = 0; goto out; }
        if (!strcmp(verb, "clear")) { p->ncper = p->npages = p->nfails = 0; memset(p->ecc_ce, 0, sizeof p->ecc_ce); memset(p->ecc_ue, 0, sizeof p->ecc_ue); goto out; }
        if (!strcmp(verb, "event") && n >= 3 && nevents < MAX_EVENTS) {
            events[nevents].proc = i;
            events[nevents].type = (uint32_t)strtoul(fields[2], NULL, 0);
            snprintf(events[nevents].message, 256, "%s", n >= 4 ? fields[3] : "");
            nevents++;
            goto out;
        }
        if (!strcmp(verb, "fail") && n >= 4) {
            for (int k = 0; k < p->nfails; k++)
                if (!strcmp(p->fails[k].function, fields[2])) { p->fails[k].status = (uint32_t)strtoul(fields[3], NULL, 0); goto out; }
            if (p->nfails < MAX_FAILS) {
                snprintf(p->fails[p->nfails].function, 80, "%s", fields[2]);
                p->fails[p->nfails++].status = (uint32_t)strtoul(fields[3], NULL, 0);
            }
            goto out;
        }
        if (!strcmp(verb, "ecc") && n >= 5) {
            int b = block_index(strtoull(fields[2], NULL, 0));
            if (b >= 0) { p->ecc_ce[b] = strtoull(fields[3], NULL, 0); p->ecc_ue[b] = strtoull(fields[4], NULL, 0); }
            goto out;
        }
        if (!strcmp(verb, "page") && n >= 5 && p->npages < MAX_PAGES) {
            page_t *g = &p->pages[p->npages++];
            g->address = strtoull(fields[2], NULL, 0);
            g->size = strtoull(fields[3], NULL, 0);
            g->status = (uint32_t)strtoul(fields[4], NULL, 0);
            goto out;
        }
        if (!strcmp(verb, "cper") && n >= 6 && p->ncper < MAX_CPER) {
            cper_t *r = &p->cper[p->ncper++];
            memset(r, 0, sizeof *r);
            r->severity = (uint32_t)strtoul(fields[2], NULL, 0);
            r->notify = strtoull(fields[3], NULL, 0);
            sscanf(fields[4], "%d/%d/%d %d:%d:%d", &r->year, &r->month, &r->day, &r->hour, &r->minute, &r->second);
            snprintf(r->id, sizeof r->id, "%s", fields[5]);
            goto out;
        }
        if (strcmp(verb, "set")) { result = -1; goto out; }
    } else {
        result = -1;
        goto out;
    }
    for (int i = first; i < n; i++) {
        char *eq = strchr(fields[i], '=');
        if (eq) { *eq = 0; set_processor(p, fields[i], eq + 1); }
    }
out:
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return result;
}

/* ---- test controls ----------------------------------------------------------------------- */

/* Calls of `name` so far ("*": of every function). */
uint64_t standin_calls(const char *name) {
    uint64_t n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < ncounters; i++)
        if (!strcmp(name, "*") || !strcmp(counters[i].name, name)) n += counters[i].count;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The handle amdsmi gives processor `index` now (NULL when not listed since amdsmi_init). */
void *standin_handle(int index) {
    pthread_mutex_lock(&lock);
    int s = initialized ? snap_of(index) : -1;
    void *h = s >= 0 ? handle_of(s) : NULL;
    pthread_mutex_unlock(&lock);
    return h;
}

uint64_t standin_event_mask(int index) {
    pthread_mutex_lock(&lock);
    uint64_t m = index >= 0 && index < nprocs ? procs[index].event_mask : 0;
    pthread_mutex_unlock(&lock);
    return m;
}

void standin_uuid(int index, char *out, uint32_t size) {
    pthread_mutex_lock(&lock);
    if (index >= 0 && index < nprocs) make_uuid(&procs[index], procs[index].partition_id, out, size);
    pthread_mutex_unlock(&lock);
}

/* Agent processes (tests/lifecycle) configure the hardware through the environment. */
__attribute__((constructor)) static void configure_from_environment(void) {
    const char *text = getenv("AMDSMI_STANDIN_COMMANDS");
    if (!text) return;
    char *copy = strdup(text);
    for (char *save = NULL, *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
        standin_command(line);
    free(copy);
}
