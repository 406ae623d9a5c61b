/* The CUDA backend: the CUDA runtime, loaded with dlopen at first use.
 *
 * Loading at run time keeps `import pinloader` working on machines with no GPU, no driver and no
 * toolkit, and lets pinloader share the runtime that torch, CuPy or JAX already brought into the
 * process: a libcudart that is already loaded is preferred over any other (see
 * Note [finding libcudart]). cuda_api.h declares the types and signatures of the functions used
 * (see Note [our own CUDA declarations]), so every function pointer below has the exact type of
 * the runtime function it stands for, and no CUDA header is needed to build.
 *
 * The function table is the one piece of process-wide mutable state; it is written once under
 * pthread_once and read-only afterwards. */
#include "backend.h"
#include "devgather.h"
#include "gather_kernel_image.h"
#include "image_kernel_image.h"
#include "jpeg_cuda.h"
#include "numa.h"
#include "util.h"

#include "cuda_api.h"
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct {
#define X(ret, name, params) ret(*name) params;
    PL_CUDA_API(X, PL_CU_T, PL_CU_TS)
#undef X
} cu;

/* Optional functions (PL_CUDA_API_OPTIONAL): NULL when the runtime is too old for them. */
static struct {
#define X(ret, name, params) ret(*name) params;
    PL_CUDA_API_OPTIONAL(X, PL_CU_T, PL_CU_TS)
#undef X
} cu_opt;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_error = PL_ERR_NO_RUNTIME; /* written once in load_runtime */
static char load_detail[768];
static char load_path[512];
static int n_devices;
static int driver_version, runtime_version;

static pthread_mutex_t candidates_mu = PTHREAD_MUTEX_INITIALIZER;
static char **candidates; /* guarded by candidates_mu */
static int n_candidates;  /* guarded by candidates_mu */

void pl_cuda_set_library_candidates(const char *const *paths, int n)
{
    pthread_mutex_lock(&candidates_mu);
    for (int i = 0; i < n_candidates; i++)
        free(candidates[i]);
    free(candidates);
    candidates = NULL;
    n_candidates = 0;
    if (n > 0 && (candidates = calloc((size_t)n, sizeof(char *)))) {
        for (int i = 0; i < n; i++)
            if ((candidates[n_candidates] = strdup(paths[i])))
                n_candidates++;
    }
    pthread_mutex_unlock(&candidates_mu);
}

/* Note [finding libcudart]
 * 1. A libcudart already in the process (torch, CuPy, JAX loaded it): RTLD_NOLOAD by soname.
 *    Sharing it means one runtime, one set of primary contexts, streams that mean the same.
 * 2. PINLOADER_CUDART, an explicit path.
 * 3. The dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache).
 * 4. Candidates from the Python package: the nvidia-cuda-runtime wheels' lib folders, torch's
 *    lib folder, CUDA_HOME/lib64, /usr/local/cuda/lib64. */
static const char *const sonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};

static void *try_open(const char *path, int flags)
{
    void *h = dlopen(path, flags);
    if (h)
        snprintf(load_path, sizeof load_path, "%s", path);
    return h;
}

static void *open_runtime(void)
{
    void *h = NULL;
    for (size_t i = 0; !h && i < sizeof sonames / sizeof *sonames; i++)
        h = try_open(sonames[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    const char *env = getenv("PINLOADER_CUDART");
    if (!h && env && *env)
        h = try_open(env, RTLD_NOW | RTLD_LOCAL);
    for (size_t i = 0; !h && i < sizeof sonames / sizeof *sonames; i++)
        h = try_open(sonames[i], RTLD_NOW | RTLD_LOCAL);
    pthread_mutex_lock(&candidates_mu);
    for (int i = 0; !h && i < n_candidates; i++)
        h = try_open(candidates[i], RTLD_NOW | RTLD_LOCAL);
    pthread_mutex_unlock(&candidates_mu);
    return h;
}

static void load_runtime(void)
{
    void *h = open_runtime();
    if (!h) {
        snprintf(load_detail, sizeof load_detail,
                 "no CUDA runtime library found (tried an already loaded libcudart, "
                 "PINLOADER_CUDART, the loader's search path and the nvidia-cuda-runtime wheels; "
                 "on a host with only the NVIDIA driver, pip install \"pinloader[cuda]\" "
                 "brings one)");
        load_error = PL_ERR_NO_RUNTIME;
        return;
    }
#define X(ret, name, params)                                                                \
    if (!(*(void **)&cu.name = dlsym(h, #name))) {                                          \
        snprintf(load_detail, sizeof load_detail, "%s lacks the symbol %s (CUDA 11.2 or newer " \
                 "is needed)", load_path, #name);                                           \
        load_error = PL_ERR_NO_RUNTIME;                                                     \
        return;                                                                             \
    }
    PL_CUDA_API(X, PL_CU_T, PL_CU_TS)
#undef X
#define X(ret, name, params) *(void **)&cu_opt.name = dlsym(h, #name);
    PL_CUDA_API_OPTIONAL(X, PL_CU_T, PL_CU_TS)
#undef X
    cu.cudaRuntimeGetVersion(&runtime_version);
    cu.cudaDriverGetVersion(&driver_version);
    pl_cudaError_t rc = cu.cudaGetDeviceCount(&n_devices);
    if (rc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        n_devices = 0;
        if (driver_version == 0)
            /* cudaDriverGetVersion reports 0 when libcuda.so.1 cannot be loaded */
            snprintf(load_detail, sizeof load_detail, "%s: no NVIDIA driver is installed "
                     "(libcuda.so.1 could not be loaded; the CUDA runtime %s, version %d, was "
                     "found)", cu.cudaGetErrorName(rc), load_path, runtime_version);
        else
            snprintf(load_detail, sizeof load_detail, "%s: %s (%s); driver version %d, runtime %d",
                     cu.cudaGetErrorName(rc), cu.cudaGetErrorString(rc), load_path,
                     driver_version, runtime_version);
        load_error = (int)rc;
        return;
    }
    if (n_devices == 0) {
        snprintf(load_detail, sizeof load_detail, "pl_cudaErrorNoDevice: no CUDA device is visible");
        load_error = (int)pl_cudaErrorNoDevice;
        return;
    }
    load_error = PL_OK;
}

void pl_cuda_versions(int *driver, int *runtime)
{
    pthread_once(&load_once, load_runtime);
    *driver = driver_version;
    *runtime = runtime_version;
}

const char *pl_cuda_library_path(void)
{
    pthread_once(&load_once, load_runtime);
    return load_path[0] ? load_path : NULL;
}

int pl_cuda_device_count(int *count)
{
    pthread_once(&load_once, load_runtime);
    *count = load_error == PL_OK ? n_devices : 0;
    return load_error;
}

/* Note [hardware work queues]
 * The CUDA driver gives each context CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (8 unless
 * the variable says otherwise, at most 32) and hands them to the process's streams in turn:
 * beyond that many streams, two share a queue, and work queued on one can wait behind the
 * other's. Beside a model in training, with 8 queues the GPU image decoder's calls lasted about
 * twice as long as with 32 and the model waited for the loader; with 32 it hardly did
 * (ResNet-18 on an H100, alternating processes: the benchmarks page). The likeliest cause, not
 * observed directly, is that streams of the decoder (its own and nvJPEG's) share the model's
 * queue; nvJPEG's pipelined mode, with 8 queues, waits for another stream's queued work and with
 * 32 does not (benchmarks/nvjpeg_contention.cu, tests/test_jpeg_decoder_gpu.py).
 * The driver reads the variable when it is initialized (cuInit): set after that, before any
 * context, it did not take effect (benchmarks/cuda_queues_probe.py). So ImageLoader asks for 32
 * only where the user has not set it, a driver is there, and it is not yet initialized in the
 * process (pinloader/_hardware_queues.py); pl_cuda_driver_state tells without initializing it:
 * libcuda loaded (or loadable), and its cuDeviceGetCount answering CUDA_ERROR_NOT_INITIALIZED
 * before cuInit and CUDA_SUCCESS after. */
int pl_cuda_driver_state(void)
{
    enum { CU_SUCCESS = 0, CU_ERROR_NOT_INITIALIZED = 3 }; /* CUresult values */
    /* a libcuda not yet loaded is loaded and kept (the runtime loads it at its first call
     * anyway; loading does not initialize it, and unloading a driver library is not safe) */
    int kept = 0;
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) {
        if (!(h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL))) {
            (void)dlerror(); /* the failure's message is not left for the thread's next caller */
            return PL_DRIVER_ABSENT;
        }
        kept = 1;
    }
    int (*count)(int *) = NULL;
    *(void **)&count = dlsym(h, "cuDeviceGetCount");
    int state = PL_DRIVER_UNKNOWN, n = 0;
    if (count) {
        const int r = count(&n);
        state = r == CU_ERROR_NOT_INITIALIZED ? PL_DRIVER_UNINITIALIZED
                : r == CU_SUCCESS             ? PL_DRIVER_INITIALIZED
                                              : PL_DRIVER_UNKNOWN;
    }
    if (!kept)
        dlclose(h);
    return state;
}

/* ---- primitives ---- */

static int cuda_set_device(int device)
{
    int cur = -1;
    if (cu.cudaGetDevice(&cur) == pl_cudaSuccess && cur == device)
        return PL_OK;
    return (int)cu.cudaSetDevice(device);
}

static int cuda_get_device(int *device)
{
    return (int)cu.cudaGetDevice(device);
}

static int cuda_thread_ignore_other_captures(void)
{
    enum pl_cudaStreamCaptureMode mode = pl_cudaStreamCaptureModeThreadLocal;
    pl_cudaError_t crc = cu.cudaThreadExchangeStreamCaptureMode(&mode);
    if (crc != pl_cudaSuccess)
        cu.cudaGetLastError();
    return (int)crc;
}

static int cuda_thread_relax_captures(int *saved)
{
    enum pl_cudaStreamCaptureMode mode = pl_cudaStreamCaptureModeRelaxed;
    pl_cudaError_t crc = cu.cudaThreadExchangeStreamCaptureMode(&mode);
    if (crc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        return (int)crc;
    }
    *saved = (int)mode;
    return PL_OK;
}

static void cuda_thread_restore_captures(int saved)
{
    enum pl_cudaStreamCaptureMode mode = (enum pl_cudaStreamCaptureMode)saved;
    if (cu.cudaThreadExchangeStreamCaptureMode(&mode) != pl_cudaSuccess)
        cu.cudaGetLastError();
}

static int cuda_stream_create(int high_priority, pl_stream **out)
{
    int least = 0, greatest = 0;
    pl_cudaError_t rc = cu.cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (rc != pl_cudaSuccess)
        return (int)rc;
    pl_cudaStream_t s;
    rc = cu.cudaStreamCreateWithPriority(&s, pl_cudaStreamNonBlocking, high_priority ? greatest : least);
    if (rc == pl_cudaSuccess)
        *out = (pl_stream *)s;
    return (int)rc;
}

static int cuda_stream_destroy(pl_stream *s)
{
    return s ? (int)cu.cudaStreamDestroy((pl_cudaStream_t)s) : PL_OK;
}

static int cuda_stream_synchronize(pl_stream *s)
{
    return (int)cu.cudaStreamSynchronize((pl_cudaStream_t)s);
}

static int cuda_stream_wait_event(pl_stream *s, pl_event *e)
{
    return (int)cu.cudaStreamWaitEvent((pl_cudaStream_t)s, (pl_cudaEvent_t)e, 0);
}

/* Events are not blocking-sync (cudaEventBlockingSync): that flag makes the driver's
 * event-handler thread spend CPU on every event, whether or not anyone waits, which costs more
 * than the spinning waits it would save: those are rare (a direct copy's producer, close()). */
static int cuda_event_create(pl_event **out)
{
    pl_cudaEvent_t e;
    pl_cudaError_t rc = cu.cudaEventCreateWithFlags(&e, pl_cudaEventDisableTiming);
    if (rc == pl_cudaSuccess)
        *out = (pl_event *)e;
    return (int)rc;
}

static int cuda_event_destroy(pl_event *e)
{
    return e ? (int)cu.cudaEventDestroy((pl_cudaEvent_t)e) : PL_OK;
}

static int cuda_event_record(pl_event *e, pl_stream *s)
{
    return (int)cu.cudaEventRecord((pl_cudaEvent_t)e, (pl_cudaStream_t)s);
}

static int cuda_event_query(pl_event *e)
{
    pl_cudaError_t rc = cu.cudaEventQuery((pl_cudaEvent_t)e);
    return rc == pl_cudaErrorNotReady ? PL_ERR_NOT_READY : (int)rc;
}

static int cuda_event_synchronize(pl_event *e)
{
    return (int)cu.cudaEventSynchronize((pl_cudaEvent_t)e);
}

/* Note [expected waits]
 * CUDA has no timed event wait, so cuda_event_wait polls (pl_event_poll, poll.c) with a short,
 * growing sleep (from 10 us, doubling, capped at 0.2 ms so that a producer waiting for a pinned
 * region notices a finished copy soon). Each poll is a wake-up and a cudaEventQuery, so a
 * wait of a millisecond polls several times; a blocking-sync event would cost the driver's
 * event thread CPU on every batch instead (see cuda_event_create). A caller that knows how long
 * such waits take says so (expect_ns: the pool keeps it per client, pool.c): the first sleep is
 * then 7/8 of it, and the polls after it start at 1/16 of it, so a wait of the usual length
 * takes two or three wake-ups. Sleeping past the completion costs no transfer time: the pool
 * waits for its oldest release, and the copies queued behind it keep the stream busy.
 * The pool learns the expectation only from waits it told nothing (every fourth wait of a
 * client, and every wait while the expectation is short): a told wait lasts at least the sleep
 * it was told to take, plus the kernel's timer slack, so an average of told waits climbs by
 * itself (to 0.4 ms for copies of 50 us). A shorter untold wait replaces the expectation at
 * once (oversleeping is what costs), a longer one moves it a quarter of the way, and waits
 * expected to take under 0.25 ms are not told at all (their polls are few anyway).
 * tests/pool_expect_check.c checks this, pl_event_poll itself included, on a virtual clock. */
static int cuda_event_wait(pl_event *e, int64_t timeout_ns, int64_t expect_ns)
{
    if (timeout_ns < 0)
        return cuda_event_synchronize(e);
    return pl_event_poll(cuda_event_query, e, timeout_ns, expect_ns);
}

/* Note [pinned slabs]
 * malloc-like anonymous memory, prefaulted by several threads, then cudaHostRegister: several
 * times faster than cudaHostAlloc for large slabs (the measurement:
 * benchmarks/results/design_measurements.md). cudaHostAlloc is the
 * fallback when registration is refused (RLIMIT_MEMLOCK, some virtualised hosts). Both are
 * portable (usable from every device's context) and mapped (kernels read a device gather's pair
 * table straight from the slab: Note [mapped tables] in transfer.c). host_free tells the two
 * apart by trying cudaHostUnregister first. */
static int cuda_host_alloc(size_t n, int numa_node, void **out)
{
    void *p = NULL;
    int rc = pl_os_alloc(n, numa_node, &p);
    if (rc == PL_OK) {
        pl_cudaError_t crc = cu.cudaHostRegister(p, PL_ALIGN_UP(n, pl_page_size()),
                                                 pl_cudaHostRegisterPortable | pl_cudaHostRegisterMapped);
        if (crc == pl_cudaSuccess) {
            *out = p;
            return PL_OK;
        }
        cu.cudaGetLastError();
        pl_os_free(p, n);
    }
    pl_cudaError_t crc = cu.cudaHostAlloc(&p, n, pl_cudaHostAllocPortable | pl_cudaHostAllocMapped);
    if (crc == pl_cudaSuccess)
        *out = p;
    return (int)crc;
}

/* See Note [slabs on the GPU's node] in numa.c. The fallback (cudaHostAlloc) above places its
 * memory where the driver chooses. */
static int cuda_numa_node(int device)
{
    char bus_id[64];
    if (cu.cudaDeviceGetPCIBusId(bus_id, (int)sizeof bus_id, device) != pl_cudaSuccess) {
        cu.cudaGetLastError();
        return -1;
    }
    bus_id[sizeof bus_id - 1] = '\0';
    return pl_numa_node_of_pci(bus_id);
}

static int cuda_host_free(void *p, size_t n)
{
    if (!p)
        return PL_OK;
    pl_cudaError_t rc = cu.cudaHostUnregister(p);
    if (rc == pl_cudaSuccess) {
        pl_os_free(p, n);
        return PL_OK;
    }
    if (rc == pl_cudaErrorCudartUnloading)
        return (int)rc; /* leak: the process is exiting */
    cu.cudaGetLastError();
    return (int)cu.cudaFreeHost(p);
}

static int cuda_host_is_pinned(const void *p, int *pinned)
{
    struct pl_cudaPointerAttributes attr;
    pl_cudaError_t rc = cu.cudaPointerGetAttributes(&attr, p);
    if (rc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        *pinned = 0;
        return PL_OK;
    }
    *pinned = attr.type == pl_cudaMemoryTypeHost;
    return PL_OK;
}

/* Note [device pool]
 * One pool per device, owned by pinloader and never destroyed (device blocks may be freed by
 * DLPack deleters until the process exits). Its release threshold is "never", so steady-state
 * allocation does not go back to the driver; internal dependencies are disabled so that
 * cudaMallocFromPoolAsync on the copy stream never reuses memory whose free is still pending on
 * a consumer's stream by inserting a wait on that stream: the copy stream must never wait on the
 * consumer's compute. Opportunistic reuse (the free already completed) stays on, but the driver
 * does not see frees on another stream complete between device-wide synchronisations, so
 * blocks are freed on the stream that allocates next (Note [deferred frees] in block.c). */
enum { MAX_DEVICES = 64 };
static pthread_mutex_t pools_mu = PTHREAD_MUTEX_INITIALIZER;
static pl_cudaMemPool_t pools[MAX_DEVICES]; /* guarded by pools_mu; written once per device */

static int device_pool(int device, pl_cudaMemPool_t *out)
{
    if (device < 0 || device >= MAX_DEVICES)
        return PL_ERR_INVALID_DEVICE;
    pthread_mutex_lock(&pools_mu);
    pl_cudaMemPool_t pool = pools[device];
    pthread_mutex_unlock(&pools_mu);
    if (pool) {
        *out = pool;
        return PL_OK;
    }
    struct pl_cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = pl_cudaMemAllocationTypePinned;
    props.handleTypes = pl_cudaMemHandleTypeNone;
    props.location.type = pl_cudaMemLocationTypeDevice;
    props.location.id = device;
    pl_cudaError_t rc = cu.cudaMemPoolCreate(&pool, &props);
    if (rc != pl_cudaSuccess)
        return (int)rc;
    uint64_t threshold = UINT64_MAX;
    int off = 0, on = 1;
    if ((rc = cu.cudaMemPoolSetAttribute(pool, pl_cudaMemPoolAttrReleaseThreshold, &threshold)) != pl_cudaSuccess ||
        (rc = cu.cudaMemPoolSetAttribute(pool, pl_cudaMemPoolReuseAllowInternalDependencies, &off)) != pl_cudaSuccess ||
        (rc = cu.cudaMemPoolSetAttribute(pool, pl_cudaMemPoolReuseAllowOpportunistic, &on)) != pl_cudaSuccess)
        return (int)rc;
    pthread_mutex_lock(&pools_mu);
    if (!pools[device])
        pools[device] = pool;
    *out = pools[device]; /* a racing creator's pool leaks once, harmlessly */
    pthread_mutex_unlock(&pools_mu);
    return PL_OK;
}

int pl_cuda_device_pool_reserved(int device, size_t *out)
{
    *out = 0;
    pl_cudaMemPool_t pool = NULL;
    int rc = device_pool(device, &pool);
    if (rc != PL_OK)
        return rc;
    uint64_t v = 0;
    if ((rc = (int)cu.cudaMemPoolGetAttribute(pool, pl_cudaMemPoolAttrReservedMemCurrent, &v)) != PL_OK)
        return rc;
    *out = (size_t)v;
    return PL_OK;
}

static int cuda_device_alloc(int device, size_t n, pl_stream *s, void **out)
{
    pl_cudaMemPool_t pool = NULL;
    int rc = device_pool(device, &pool);
    if (rc != PL_OK)
        return rc;
    pl_cudaError_t crc = cu.cudaMallocFromPoolAsync(out, n ? n : 1, pool, (pl_cudaStream_t)s);
    if (crc != pl_cudaSuccess)
        cu.cudaGetLastError(); /* out of memory is not sticky: leave no error for the thread's next call */
    return (int)crc;
}

static int cuda_device_free(int device, void *p, pl_stream *s)
{
    (void)device;
    return (int)cu.cudaFreeAsync(p, (pl_cudaStream_t)s);
}

static int cuda_memcpy_h2d_async(void *dst, const void *src, size_t n, pl_stream *s)
{
    return (int)cu.cudaMemcpyAsync(dst, src, n, pl_cudaMemcpyHostToDevice, (pl_cudaStream_t)s);
}

static int cuda_memcpy_d2d_async(void *dst, const void *src, size_t n, pl_stream *s)
{
    return (int)cu.cudaMemcpyAsync(dst, src, n, pl_cudaMemcpyDeviceToDevice, (pl_cudaStream_t)s);
}

static int cuda_memzero_async(void *dst, size_t n, pl_stream *s)
{
    return (int)cu.cudaMemsetAsync(dst, 0, n, (pl_cudaStream_t)s);
}

static int cuda_memcpy_d2h(void *dst, const void *src, size_t n)
{
    return (int)cu.cudaMemcpy(dst, src, n, pl_cudaMemcpyDeviceToHost);
}

static void hold_fn(void *gate)
{
    while (!__atomic_load_n((int *)gate, __ATOMIC_ACQUIRE))
        pl_sleep_ns(100000);
}

static int cuda_stream_hold(pl_stream *s, volatile int *gate)
{
    return (int)cu.cudaLaunchHostFunc((pl_cudaStream_t)s, hold_fn, (void *)gate);
}

/* ---- device gather (Note [device gather] in devgather.h) ---- */

/* Registered sources are read by kernels of any device (portable), through a mapping. A
 * source NumPy says is read-only (np.load(mmap_mode="r"), whose file mapping registers only
 * read-only) is registered read-only first, which is also faster
 * (benchmarks/results/design_measurements.md); a writable one writable first,
 * so that copies into it (a D2H copy into the dataset) keep working; each falls back to the
 * other. Only whole pages of the source are ever registered (Note [registered sources] in
 * devgather.h). */
static int try_register(void *p, size_t n, int read_only)
{
    unsigned flags = pl_cudaHostRegisterPortable | pl_cudaHostRegisterMapped |
                     (read_only ? pl_cudaHostRegisterReadOnly : 0);
    pl_cudaError_t crc = cu.cudaHostRegister(p, n, flags);
    if (crc != pl_cudaSuccess)
        cu.cudaGetLastError();
    return (int)crc;
}

static int cuda_host_register(int device, void *p, size_t n, int prefer_read_only, void **dev, int *read_only)
{
    int rc = cuda_set_device(device);
    if (rc != PL_OK)
        return rc;
    int supported = 0;
    if (cu.cudaDeviceGetAttribute(&supported, pl_cudaDevAttrHostRegisterReadOnlySupported, device) != pl_cudaSuccess) {
        cu.cudaGetLastError();
        supported = 0;
    }
    int ro = prefer_read_only && supported;
    rc = try_register(p, n, ro);
    if (rc != PL_OK && rc != (int)pl_cudaErrorHostMemoryAlreadyRegistered && (ro || supported)) {
        ro = !ro;
        rc = try_register(p, n, ro);
    }
    if (rc != PL_OK)
        return rc;
    void *d = NULL;
    pl_cudaError_t crc = cu.cudaHostGetDevicePointer(&d, p, 0);
    if (crc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        cu.cudaHostUnregister(p);
        cu.cudaGetLastError();
        return (int)crc;
    }
    *dev = d;
    *read_only = ro;
    return PL_OK;
}

static int cuda_host_unregister(void *p)
{
    pl_cudaError_t rc = cu.cudaHostUnregister(p);
    if (rc != pl_cudaSuccess)
        cu.cudaGetLastError();
    return (int)rc;
}

/* Both ends of the range in page-locked memory that maps them as one range: its device
 * address. Memory pinned in two separate pieces that happen to be adjacent maps them
 * consistently too, which is all the kernel needs. */
static int cuda_host_mapped(const void *p, size_t n, void **dev)
{
    *dev = NULL;
    struct pl_cudaPointerAttributes a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    if (cu.cudaPointerGetAttributes(&a, p) != pl_cudaSuccess ||
        cu.cudaPointerGetAttributes(&b, (const char *)p + (n ? n - 1 : 0)) != pl_cudaSuccess) {
        cu.cudaGetLastError();
        return PL_OK;
    }
    if (a.type == pl_cudaMemoryTypeHost && b.type == pl_cudaMemoryTypeHost && a.devicePointer &&
        b.devicePointer && (size_t)((char *)b.devicePointer - (char *)a.devicePointer) == (n ? n - 1 : 0))
        *dev = a.devicePointer;
    return PL_OK;
}

static int cuda_host_device_ptr(void *p, void **dev)
{
    void *d = NULL;
    pl_cudaError_t crc = cu.cudaHostGetDevicePointer(&d, p, 0);
    if (crc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        return (int)crc;
    }
    *dev = d;
    return PL_OK;
}

/* The kernels of src/core/gather_kernel.cu, by unit size, loaded once per process. A library is
 * not tied to a context: the driver loads it into each device's context at its first launch
 * there (JIT-compiling the PTX if no cubin fits the device). */
static const char *const gather_kernel_names[5] = {"pl_gather_1", "pl_gather_2", "pl_gather_4",
                                                   "pl_gather_8", "pl_gather_16"};
static pthread_once_t gather_once = PTHREAD_ONCE_INIT;
static pl_cudaKernel_t gather_kernels[5]; /* written once in load_gather */
static int gather_error;                  /* written once in load_gather */
static const char *gather_why;            /* written once in load_gather */

static void load_gather(void)
{
    if (!cu_opt.cudaLibraryLoadData || !cu_opt.cudaLibraryGetKernel) {
        gather_error = PL_ERR_NO_RUNTIME;
        gather_why = "the CUDA runtime is older than 12.0 (no cudaLibraryLoadData)";
        return;
    }
    pl_cudaLibrary_t lib = NULL;
    pl_cudaError_t rc = cu_opt.cudaLibraryLoadData(&lib, pl_gather_image, NULL, NULL, 0, NULL, NULL, 0);
    if (rc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        gather_error = (int)rc;
        gather_why = "the driver could not load the gather kernel (cudaLibraryLoadData)";
        return;
    }
    for (int i = 0; i < 5; i++) {
        rc = cu_opt.cudaLibraryGetKernel(&gather_kernels[i], lib, gather_kernel_names[i]);
        if (rc != pl_cudaSuccess) {
            cu.cudaGetLastError();
            gather_error = (int)rc;
            gather_why = "the gather kernel image lacks a kernel (cudaLibraryGetKernel)";
            return;
        }
    }
    gather_error = PL_OK;
}

enum { MAX_GATHER_DEVICES = 64 };
static atomic_int sm_count[MAX_GATHER_DEVICES]; /* 0: not read yet */
static atomic_uint grid_cap;                     /* 0: the default; see pl_cuda_gather_grid */

unsigned pl_cuda_gather_grid(unsigned max_blocks)
{
    return atomic_exchange(&grid_cap, max_blocks);
}

static int cuda_gather_ready(int device, const char **why)
{
    pthread_once(&gather_once, load_gather);
    if (gather_error != PL_OK) {
        *why = gather_why;
        return gather_error;
    }
    if (device < 0 || device >= MAX_GATHER_DEVICES) {
        *why = "the device ordinal is out of range";
        return PL_ERR_INVALID_DEVICE;
    }
    int n = 0;
    pl_cudaError_t rc = cu.cudaDeviceGetAttribute(&n, pl_cudaDevAttrMultiProcessorCount, device);
    if (rc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        *why = "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount) failed";
        return (int)rc;
    }
    atomic_store(&sm_count[device], n > 0 ? n : 1);
    return PL_OK;
}

static int cuda_gather_launch(const pl_gather_args *g, pl_stream *s)
{
    const char *why;
    int rc = cuda_gather_ready(g->device, &why);
    if (rc != PL_OK)
        return rc;
    const int unit = pl_gather_unit(g);
    const int k = __builtin_ctz((unsigned)unit);
    char *dst = g->dst;
    const pl_gather_pair *table = g->table;
    const char *src = g->src, *edge = g->edge;
    long long row_stride = (long long)g->row_stride;
    unsigned long long span_units = g->span / (size_t)unit;
    unsigned long long total;
    if (__builtin_mul_overflow(span_units, (unsigned long long)g->n, &total))
        return PL_ERR_INVALID_VALUE;
    /* 256 threads a block, at most 16 blocks per multiprocessor: each thread keeps 4 loads in
     * flight (UNROLL in the kernel). Fewer blocks are slower; more blocks or a deeper unroll
     * gain nothing (benchmarks/bench_gather_kernel.py compares them; the measurements:
     * benchmarks/results/design_measurements.md). */
    const unsigned long long threads = 256;
    unsigned long long blocks = (total + threads - 1) / threads;
    unsigned long long max_blocks = atomic_load(&grid_cap);
    if (!max_blocks)
        max_blocks = (unsigned long long)atomic_load(&sm_count[g->device]) * 16;
    if (blocks > max_blocks)
        blocks = max_blocks;
    void *args[] = {&dst, &table, &src, &edge, &row_stride, &span_units, &total};
    struct pl_dim3 grid = {(unsigned)blocks, 1, 1}, block = {(unsigned)threads, 1, 1};
    pl_cudaError_t crc = cu.cudaLaunchKernel((const void *)gather_kernels[k], grid, block, args, 0,
                                             (pl_cudaStream_t)s);
    if (crc != pl_cudaSuccess)
        cu.cudaGetLastError();
    return (int)crc;
}

/* The image kernels of src/core/image_kernel.cu (jpeg_cuda.c launches them), loaded once per
 * process like the gather kernels. */
static const char *const image_kernel_names[PL_IMAGE_KERNELS] = {
    "pl_image_h", "pl_image_v_u8", "pl_image_v_f32", "pl_image_v_f16", "pl_image_v_bf16", "pl_image_w"};
static pthread_once_t image_once = PTHREAD_ONCE_INIT;
static pl_cudaKernel_t image_kernels[PL_IMAGE_KERNELS]; /* written once in load_image */
static int image_error;                  /* written once in load_image */
static const char *image_why;            /* written once in load_image */

static void load_image(void)
{
    if (!cu_opt.cudaLibraryLoadData || !cu_opt.cudaLibraryGetKernel) {
        image_error = PL_ERR_NO_RUNTIME;
        image_why = "the CUDA runtime is older than 12.0 (no cudaLibraryLoadData)";
        return;
    }
    pl_cudaLibrary_t lib = NULL;
    pl_cudaError_t rc = cu_opt.cudaLibraryLoadData(&lib, pl_image_kernels, NULL, NULL, 0, NULL, NULL, 0);
    if (rc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        image_error = (int)rc;
        image_why = "the driver could not load the image kernels (cudaLibraryLoadData)";
        return;
    }
    for (int i = 0; i < PL_IMAGE_KERNELS; i++) {
        rc = cu_opt.cudaLibraryGetKernel(&image_kernels[i], lib, image_kernel_names[i]);
        if (rc != pl_cudaSuccess) {
            cu.cudaGetLastError();
            image_error = (int)rc;
            image_why = "the image kernel image lacks a kernel (cudaLibraryGetKernel)";
            return;
        }
    }
    image_error = PL_OK;
}

int pl_cuda_image_launch(int device, int which, unsigned grid_x, unsigned grid_y, void **args,
                         pl_stream *s, const char **why)
{
    (void)device;
    pthread_once(&load_once, load_runtime);
    if (load_error != PL_OK) {
        *why = "the CUDA runtime is not usable";
        return load_error;
    }
    pthread_once(&image_once, load_image);
    if (image_error != PL_OK) {
        *why = image_why;
        return image_error;
    }
    if (which < 0 || which >= PL_IMAGE_KERNELS || grid_x == 0 || grid_y == 0 || grid_y > 65535) {
        *why = "an image kernel launch with an impossible shape";
        return PL_ERR_INVALID_VALUE;
    }
    struct pl_dim3 grid = {grid_x, grid_y, 1}, block = {256, 1, 1};
    pl_cudaError_t crc = cu.cudaLaunchKernel((const void *)image_kernels[which], grid, block, args, 0,
                                             (pl_cudaStream_t)s);
    if (crc != pl_cudaSuccess) {
        cu.cudaGetLastError();
        *why = "cudaLaunchKernel of an image kernel failed";
    }
    return (int)crc;
}

static const char *cuda_error_name(int code)
{
    return cu.cudaGetErrorName ? cu.cudaGetErrorName((pl_cudaError_t)code) : "cudaErrorUnknown";
}

static const char *cuda_error_string(int code)
{
    return cu.cudaGetErrorString ? cu.cudaGetErrorString((pl_cudaError_t)code) : "unknown error";
}

static const pl_backend cuda_backend = {
    .name = "cuda",
    .kind = PL_BACKEND_CUDA,
    .set_device = cuda_set_device,
    .get_device = cuda_get_device,
    .thread_ignore_other_captures = cuda_thread_ignore_other_captures,
    .thread_relax_captures = cuda_thread_relax_captures,
    .thread_restore_captures = cuda_thread_restore_captures,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .stream_wait_event = cuda_stream_wait_event,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .event_wait = cuda_event_wait,
    .host_alloc = cuda_host_alloc,
    .numa_node = cuda_numa_node,
    .host_free = cuda_host_free,
    .host_is_pinned = cuda_host_is_pinned,
    .device_alloc = cuda_device_alloc,
    .device_free = cuda_device_free,
    .memcpy_h2d_async = cuda_memcpy_h2d_async,
    .memcpy_d2d_async = cuda_memcpy_d2d_async,
    .memzero_async = cuda_memzero_async,
    .memcpy_d2h = cuda_memcpy_d2h,
    .stream_hold = cuda_stream_hold,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .host_mapped = cuda_host_mapped,
    .host_device_ptr = cuda_host_device_ptr,
    .gather_ready = cuda_gather_ready,
    .gather_launch = cuda_gather_launch,
    .error_name = cuda_error_name,
    .error_string = cuda_error_string,
};

const pl_backend *pl_backend_cuda(int *err, const char **detail)
{
    pthread_once(&load_once, load_runtime);
    if (load_error != PL_OK) {
        if (err)
            *err = load_error;
        if (detail)
            *detail = load_detail;
        return NULL;
    }
    return &cuda_backend;
}
