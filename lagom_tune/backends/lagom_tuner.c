/*
 * lagom-tune's NCCL tuner plugin: per-collective algorithm, protocol and channel count on stock NCCL.
 *
 * NCCL (2.19 and newer) dlopens the library named by NCCL_TUNER_PLUGIN and looks for the newest
 * `ncclTunerPlugin_vN` symbol it knows. For every collective it calls getCollInfo with the
 * collective, its size and (v3 and newer) its cost table of algorithm x protocol times; the plugin
 * may lower an entry to make NCCL pick it and may set the number of channels.
 *
 * This plugin reads the rules `lagom-tune apply` writes from a plan (file named by the environment
 * variable LAGOM_TUNE_TUNER_RULES) and, for each call, applies the first rule that matches the
 * collective, the communicator (nRanks, nNodes) and the size. With no matching rule it changes
 * nothing. It never makes an entry NCCL marked unavailable the cheapest. It counts what reached
 * NCCL (per rule, the calls it was applied to and skipped on) and, from each cost table as NCCL
 * handed it over, NCCL's own choice for the call; lagom-tune's shim reads both at a rank's exit.
 *
 * Rules file (text; '#' starts a comment line; fields separated by blanks):
 *
 *     lagom-tune-tuner-rules 1
 *     <coll> <nRanks|*> <nNodes|*> <minBytes> <maxBytes> <algo|*> <proto|*> <channels|*>
 *
 *   coll:  broadcast reduce allgather reducescatter allreduce
 *   algo:  tree ring collnet_direct collnet_chain nvls nvls_tree pat
 *   proto: ll ll128 simple
 *
 * A malformed or unreadable file is reported through NCCL's logger (WARN) and the plugin then
 * leaves every collective to NCCL. It does not fail init: NCCL treats a failing tuner init as a
 * failed communicator init, which would stop the user's training.
 *
 * Everything below is declared from NCCL's public plugin headers (src/include/plugin/tuner/
 * tuner_v2.h .. tuner_v7.h, nccl_common.h, and 2.19's nccl_tuner.h for v1); only the parts this
 * plugin touches are given real types, the rest are passed through as opaque pointers.
 * Built by lagom_tune/backends/tuner_build.py with the system C compiler; no CUDA headers needed.
 */

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- NCCL ABI facts ------------------------------------------------------------------------ */

typedef enum { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidArgument = 4 } ncclResult_t;
typedef int ncclFunc_t; /* an enum in NCCL: int-sized */

/* ncclDebugLogLevel and ncclDebugLogSubSys values (nccl_common.h; the same since 2.19). */
enum { NCCL_LOG_WARN = 2, NCCL_LOG_INFO = 3 };
#define NCCL_TUNING_SUBSYS 0x40UL

typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

/* ncclFunc_t values NCCL asks the tuner about (NCCL_NUM_FUNCTIONS = 5). */
enum { FUNC_BROADCAST = 0, FUNC_REDUCE = 1, FUNC_ALLGATHER = 2, FUNC_REDUCESCATTER = 3, FUNC_ALLREDUCE = 4, NUM_FUNCS = 5 };
/* NCCL_ALGO_* and NCCL_PROTO_* indices into the cost table. */
enum { ALGO_TREE = 0, ALGO_RING = 1, ALGO_COLLNET_DIRECT = 2, ALGO_COLLNET_CHAIN = 3, ALGO_NVLS = 4, ALGO_NVLS_TREE = 5,
       ALGO_PAT = 6, NUM_ALGOS = 7 };
enum { PROTO_LL = 0, PROTO_LL128 = 1, PROTO_SIMPLE = 2, NUM_PROTOS = 3 };
#define UNSET (-1) /* NCCL_ALGO_UNDEF / NCCL_PROTO_UNDEF, and "no value" in a rule */

typedef ncclResult_t (*chunk_size_fn)(void* ctx, ncclFunc_t coll, size_t nBytes, int algo, int proto, int nChannels,
                                      size_t* chunkSize);

/* v1 (NCCL 2.19, 2.20): no context; the plugin returns algorithm and protocol directly. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t log);
  ncclResult_t (*getCollInfo)(ncclFunc_t coll, size_t nBytes, int collNetSupport, int nvlsSupport, int numPipeOps,
                              int* algorithm, int* protocol, int* nChannels);
  ncclResult_t (*destroy)(void);
} tuner_v1_t;

/* v2 (2.21): a context per communicator; still algorithm and protocol as outputs. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx);
  ncclResult_t (*getCollInfo)(void* ctx, ncclFunc_t coll, size_t nBytes, int collNetSupport, int nvlsSupport,
                              int numPipeOps, int* algorithm, int* protocol, int* nChannels);
  ncclResult_t (*destroy)(void* ctx);
} tuner_v2_t;

/* v3 (2.22, 2.23): the cost table float[numAlgo][numProto], passed as float**; -1.0 marks an entry unavailable. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx);
  ncclResult_t (*getCollInfo)(void* ctx, ncclFunc_t coll, size_t nBytes, int numPipeOps, float** costTable,
                              int numAlgo, int numProto, int* nChannels);
  ncclResult_t (*destroy)(void* ctx);
} tuner_v3_t;

/* v4 (2.24 - 2.27): adds regBuff. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx);
  ncclResult_t (*getCollInfo)(void* ctx, ncclFunc_t coll, size_t nBytes, int numPipeOps, float** costTable,
                              int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*destroy)(void* ctx);
} tuner_v4_t;

/* v5 (2.28, 2.29): init takes the communicator id, NVLink-domain info and the tuning constants
 * (both only passed through here); destroy is named finalize. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                       void* nvlDomainInfo, void* constants);
  ncclResult_t (*getCollInfo)(void* ctx, ncclFunc_t coll, size_t nBytes, int numPipeOps, float** costTable,
                              int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* ctx);
} tuner_v5_t;

/* v6 (2.30 - 2.32.3) and v7 (2.32.6): v5 plus an optional getChunkSize (NULL: NCCL keeps its own).
 * v7 only widens the constants struct, which this plugin never reads. Which release looks up which:
 * bench/results/nccl_tuner_versions.md. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                       void* nvlDomainInfo, void* constants);
  ncclResult_t (*getCollInfo)(void* ctx, ncclFunc_t coll, size_t nBytes, int numPipeOps, float** costTable,
                              int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* ctx);
  chunk_size_fn getChunkSize;
} tuner_v6_t;

/* ---- rules ------------------------------------------------------------------------------------ */

#define PLUGIN_NAME "lagom-tune"
#define RULES_ENV "LAGOM_TUNE_TUNER_RULES"
#define RULES_MAGIC "lagom-tune-tuner-rules"
#define RULES_VERSION 1
#define MAX_FILE_BYTES (1 << 20)
#define MAX_LINE 1024
#define MAX_RULES 4096
#define MAX_CHANNELS 1024
#define ANY (-1L)

static const char* const FUNC_NAMES[NUM_FUNCS] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
static const char* const ALGO_NAMES[NUM_ALGOS] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls",
                                                  "nvls_tree", "pat"};
static const char* const PROTO_NAMES[NUM_PROTOS] = {"ll", "ll128", "simple"};

typedef struct {
  int coll;
  long nRanks, nNodes; /* ANY matches every communicator */
  unsigned long long minBytes, maxBytes;
  int algo, proto;     /* UNSET: leave NCCL's choice */
  int channels;        /* UNSET: leave NCCL's choice */
  int line;            /* line in the rules file, for the log */
  int ordinal;         /* its place among the file's rules, for the counts */
} rule_t;

/* Once-per-rule log flags. */
enum { LOGGED_APPLIED = 1, LOGGED_SKIPPED = 2 };

typedef struct {
  rule_t* rules; /* only those for this communicator's nRanks/nNodes */
  unsigned char* logged;
  int n;
  ncclDebugLogger_t log;
  size_t nRanks, nNodes;
  int user_narrowed; /* NCCL_ALGO or NCCL_PROTO set: v1/v2 cannot see what they exclude */
} context_t;

static void say(const context_t* c, int level, int line, const char* fmt, ...) __attribute__((format(printf, 4, 5)));
static void say(const context_t* c, int level, int line, const char* fmt, ...) {
  if (c == NULL || c->log == NULL) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* NCCL's logger takes a printf format: pass the message as an argument so a '%' in it is inert. */
  /* A WARN goes to every subsystem, as NCCL's own WARNs do (NCCL_ALL): NCCL drops a message none
   * of whose subsystems NCCL_DEBUG_SUBSYS names, and its default names INIT, BOOTSTRAP and ENV. */
  c->log(level, level == NCCL_LOG_WARN ? ~0UL : NCCL_TUNING_SUBSYS, __FILE__, line, "%s", msg);
}

static int index_of(const char* word, const char* const* names, int n) {
  for (int i = 0; i < n; i++)
    if (strcmp(word, names[i]) == 0) return i;
  return UNSET;
}

/* A decimal number in [lo, hi]; "*" gives `any` when `any_ok`. Returns 0 on success. */
static int parse_number(const char* word, unsigned long long lo, unsigned long long hi, int any_ok,
                        unsigned long long* out, int* is_any) {
  *is_any = 0;
  if (any_ok && strcmp(word, "*") == 0) {
    *is_any = 1;
    return 0;
  }
  if (*word == '\0') return -1;
  unsigned long long v = 0;
  for (const char* p = word; *p; p++) {
    if (*p < '0' || *p > '9') return -1;
    unsigned digit = (unsigned)(*p - '0');
    if (v > (hi - digit) / 10) return -1; /* would exceed hi (and so never overflows) */
    v = v * 10 + digit;
  }
  if (v < lo) return -1;
  *out = v;
  return 0;
}

static int is_blank(char ch) { return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\v' || ch == '\f'; }

/* Split `buf` in place into at most `max` blank-separated words (strtok is not thread-safe, and
 * NCCL may create communicators from several threads). */
static int split_words(char* buf, char** words, int max) {
  int n = 0;
  char* p = buf;
  while (*p && n < max) {
    while (is_blank(*p)) p++;
    if (!*p) break;
    words[n++] = p;
    while (*p && !is_blank(*p)) p++;
    if (*p) *p++ = '\0';
  }
  return n;
}

static int set_error(char* err, size_t errlen, int line, const char* what) {
  if (err && errlen) snprintf(err, errlen, "line %d: %s", line, what);
  return -1;
}

/* Parse one rule line already split into 8 words. Returns 0 or -1 with `err` set. */
static int parse_rule(char** w, int line, rule_t* r, char* err, size_t errlen) {
  unsigned long long v;
  int any;
  memset(r, 0, sizeof *r);
  r->line = line;
  if ((r->coll = index_of(w[0], FUNC_NAMES, NUM_FUNCS)) == UNSET) return set_error(err, errlen, line, "unknown collective");
  if (parse_number(w[1], 1, 1UL << 30, 1, &v, &any)) return set_error(err, errlen, line, "bad nRanks");
  r->nRanks = any ? ANY : (long)v;
  if (parse_number(w[2], 1, 1UL << 30, 1, &v, &any)) return set_error(err, errlen, line, "bad nNodes");
  r->nNodes = any ? ANY : (long)v;
  if (parse_number(w[3], 0, (unsigned long long)INT64_MAX, 0, &r->minBytes, &any)) return set_error(err, errlen, line, "bad minBytes");
  if (parse_number(w[4], 0, (unsigned long long)INT64_MAX, 0, &r->maxBytes, &any)) return set_error(err, errlen, line, "bad maxBytes");
  if (r->minBytes > r->maxBytes) return set_error(err, errlen, line, "minBytes above maxBytes");
  r->algo = strcmp(w[5], "*") == 0 ? UNSET : index_of(w[5], ALGO_NAMES, NUM_ALGOS);
  if (r->algo == UNSET && strcmp(w[5], "*") != 0) return set_error(err, errlen, line, "unknown algorithm");
  r->proto = strcmp(w[6], "*") == 0 ? UNSET : index_of(w[6], PROTO_NAMES, NUM_PROTOS);
  if (r->proto == UNSET && strcmp(w[6], "*") != 0) return set_error(err, errlen, line, "unknown protocol");
  if (parse_number(w[7], 1, MAX_CHANNELS, 1, &v, &any)) return set_error(err, errlen, line, "bad channels");
  r->channels = any ? UNSET : (int)v;
  if (r->algo == UNSET && r->proto == UNSET && r->channels == UNSET) return set_error(err, errlen, line, "rule sets nothing");
  return 0;
}

/* Parse a whole rules text. On success returns the number of rules and, when `out` is not NULL,
 * a malloc'd array of them in *out; on failure returns -1 with a message in `err`. */
static int parse_rules(const char* text, size_t len, rule_t** out, char* err, size_t errlen) {
  if (out) *out = NULL;
  if (len > MAX_FILE_BYTES) return set_error(err, errlen, 0, "file too large");
  if (memchr(text, '\0', len) != NULL) return set_error(err, errlen, 0, "NUL byte in file");
  rule_t* rules = NULL;
  int n = 0, line = 0, seen_header = 0;
  size_t pos = 0;
  while (pos < len) {
    size_t end = pos;
    while (end < len && text[end] != '\n') end++;
    line++;
    if (end - pos >= MAX_LINE) { free(rules); return set_error(err, errlen, line, "line too long"); }
    char buf[MAX_LINE];
    memcpy(buf, text + pos, end - pos);
    buf[end - pos] = '\0';
    pos = end + 1;

    char* words[9];
    int nw = split_words(buf, words, 9);
    if (nw == 0 || words[0][0] == '#') continue;
    if (!seen_header) {
      if (nw != 2 || strcmp(words[0], RULES_MAGIC) != 0) { free(rules); return set_error(err, errlen, line, "not a lagom-tune rules file (expected '" RULES_MAGIC " 1')"); }
      if (strcmp(words[1], "1") != 0) { free(rules); return set_error(err, errlen, line, "unsupported rules version"); }
      seen_header = 1;
      continue;
    }
    if (nw != 8) { free(rules); return set_error(err, errlen, line, "expected 8 fields"); }
    if (n >= MAX_RULES) { free(rules); return set_error(err, errlen, line, "too many rules"); }
    if (out) {
      rule_t* grown = realloc(rules, (size_t)(n + 1) * sizeof *rules);
      if (!grown) { free(rules); return set_error(err, errlen, line, "out of memory"); }
      rules = grown;
      if (parse_rule(words, line, &rules[n], err, errlen)) { free(rules); return -1; }
    } else {
      rule_t scratch;
      if (parse_rule(words, line, &scratch, err, errlen)) return -1;
    }
    n++;
  }
  if (!seen_header) { free(rules); return set_error(err, errlen, line, "empty file (no '" RULES_MAGIC " 1' line)"); }
  if (out) *out = rules;
  else free(rules);
  return n;
}

/* Read at most MAX_FILE_BYTES + 1 bytes of `path` into a malloc'd buffer. */
static char* read_file(const char* path, size_t* len, char* err, size_t errlen) {
  FILE* f = fopen(path, "rb");
  if (!f) { /* the file as a whole: no line to name, and why */
    if (err && errlen) snprintf(err, errlen, "cannot open the rules file: %s", strerror(errno));
    return NULL;
  }
  char* buf = malloc(MAX_FILE_BYTES + 1);
  if (!buf) { fclose(f); set_error(err, errlen, 0, "out of memory"); return NULL; }
  *len = fread(buf, 1, MAX_FILE_BYTES + 1, f);
  int failed = ferror(f);
  fclose(f);
  if (failed) { free(buf); set_error(err, errlen, 0, "cannot read the rules file"); return NULL; }
  return buf;
}

/* Validate a rules text (for tests and tools): the number of rules, or -1 with `err` set. */
EXPORT int lagom_tuner_check_text(const char* text, size_t len, char* err, size_t errlen) {
  if (text == NULL) return set_error(err, errlen, 0, "no text");
  return parse_rules(text, len, NULL, err, errlen);
}

/* Validate a rules file: the number of rules, or -1 with `err` set. */
EXPORT int lagom_tuner_check_file(const char* path, char* err, size_t errlen) {
  size_t len = 0;
  if (path == NULL) return set_error(err, errlen, 0, "no path");
  char* text = read_file(path, &len, err, errlen);
  if (!text) return -1;
  int n = parse_rules(text, len, NULL, err, errlen);
  free(text);
  return n;
}

/* ---- what reached NCCL ------------------------------------------------------------------------ */

/* Per rule of the file (by ordinal), the calls it was applied to and those whose algorithm or
 * protocol it skipped; per collective, the calls no rule matched (NCCL's own choice). Process-wide,
 * so every communicator's calls add up; read by lagom-tune's shim in the same process at exit. */
static int g_rules;
static int g_line[MAX_RULES];
static unsigned long long g_applied[MAX_RULES], g_skipped[MAX_RULES], g_unmatched[NUM_FUNCS];

static void count(unsigned long long* counter) { __atomic_add_fetch(counter, 1ULL, __ATOMIC_RELAXED); }

/* NCCL's own choice: per span (0: a communicator within one node, 1: across nodes), collective,
 * power-of-two size bucket (bucket b holds sizes 2^b .. 2^(b+1)-1, bucket 0 also 0 B) and (algo,
 * proto), the calls whose cost table, as NCCL handed it over, made that entry the cheapest: what
 * NCCL runs where no rule applies (its topoGetAlgoInfo picks the first strictly cheapest entry of
 * at least 0 and below an hour, in algo-then-proto order). Counted for every call that came with a
 * cost table (v3 and newer), before any rule changes it. */
#define SIZE_BUCKETS 48
#define NCCL_MAX_TIME 3600000000.0f
static unsigned long long g_own[2][NUM_FUNCS][SIZE_BUCKETS][NUM_ALGOS][NUM_PROTOS];

static int size_bucket(size_t nBytes) {
  int b = 0;
  while (nBytes > 1 && b < SIZE_BUCKETS - 1) {
    nBytes >>= 1;
    b++;
  }
  return b;
}

static void count_nccl_choice(const context_t* c, ncclFunc_t coll, size_t nBytes, const float* table, int numAlgo,
                              int numProto) {
  if (c == NULL || coll < 0 || coll >= NUM_FUNCS) return;
  float least = NCCL_MAX_TIME;
  int algo = UNSET, proto = UNSET;
  for (int a = 0; a < numAlgo; a++)
    for (int p = 0; p < numProto; p++) {
      float t = table[a * numProto + p];
      if (t >= 0.0f && t < least) {
        least = t;
        algo = a;
        proto = p;
      }
    }
  /* an algorithm or protocol newer than this plugin knows of is not counted */
  if (algo >= 0 && algo < NUM_ALGOS && proto >= 0 && proto < NUM_PROTOS)
    count(&g_own[c->nNodes > 1][coll][size_bucket(nBytes)][algo][proto]);
}

/* NCCL's own choices so far (g_own, flattened in its index order) into `out` (up to `len`
 * entries; NULL to ask the size); returns the number of entries the array has. */
EXPORT int lagom_tuner_nccl_choices(unsigned long long* out, size_t len) {
  unsigned long long* all = &g_own[0][0][0][0][0];
  size_t n = sizeof g_own / sizeof *all;
  for (size_t i = 0; out && i < n && i < len; i++) out[i] = __atomic_load_n(&all[i], __ATOMIC_RELAXED);
  return (int)n;
}

/* The counts so far: fills lines/applied/skipped for up to `max` rules and unmatched[NUM_FUNCS]
 * (any pointer may be NULL), and returns the number of rules in the file the plugin last read. */
EXPORT int lagom_tuner_counts(int max, int* lines, unsigned long long* applied, unsigned long long* skipped,
                              unsigned long long* unmatched) {
  int n = __atomic_load_n(&g_rules, __ATOMIC_RELAXED);
  for (int i = 0; i < n && i < max; i++) {
    if (lines) lines[i] = g_line[i];
    if (applied) applied[i] = __atomic_load_n(&g_applied[i], __ATOMIC_RELAXED);
    if (skipped) skipped[i] = __atomic_load_n(&g_skipped[i], __ATOMIC_RELAXED);
  }
  for (int f = 0; unmatched && f < NUM_FUNCS; f++) unmatched[f] = __atomic_load_n(&g_unmatched[f], __ATOMIC_RELAXED);
  return n;
}

/* ---- the plugin ------------------------------------------------------------------------------- */

static ncclResult_t plugin_init(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx_out) {
  context_t* c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  c->log = log;
  c->user_narrowed = getenv("NCCL_ALGO") != NULL || getenv("NCCL_PROTO") != NULL;
  c->nRanks = nRanks;
  c->nNodes = nNodes;
  *ctx_out = c;

  const char* path = getenv(RULES_ENV);
  if (path == NULL || *path == '\0') {
    say(c, NCCL_LOG_INFO, __LINE__, "lagom-tune tuner: %s not set; NCCL's own choices are kept", RULES_ENV);
    return ncclSuccess;
  }
  char err[256] = "";
  size_t len = 0;
  char* text = read_file(path, &len, err, sizeof err);
  rule_t* all = NULL;
  int n = text ? parse_rules(text, len, &all, err, sizeof err) : -1;
  free(text);
  if (n < 0) {
    say(c, NCCL_LOG_WARN, __LINE__, "lagom-tune tuner: rules file %s is not usable (%s); NCCL's own choices are kept",
        path, err);
    return ncclSuccess;
  }
  for (int i = 0; i < n; i++) {
    all[i].ordinal = i;
    g_line[i] = all[i].line;
  }
  __atomic_store_n(&g_rules, n, __ATOMIC_RELAXED);
  /* Keep only the rules for this communicator, so each call only checks collective and size. */
  int kept = 0;
  for (int i = 0; i < n; i++) {
    if ((all[i].nRanks == ANY || (size_t)all[i].nRanks == nRanks) && (all[i].nNodes == ANY || (size_t)all[i].nNodes == nNodes))
      all[kept++] = all[i];
  }
  c->rules = all;
  c->n = kept;
  c->logged = kept ? calloc((size_t)kept, 1) : NULL;
  if (kept && !c->logged) { free(all); c->rules = NULL; c->n = 0; }
  say(c, NCCL_LOG_INFO, __LINE__, "lagom-tune tuner: %d of %d rules from %s apply to this communicator (nRanks %zu, nNodes %zu)",
      c->n, n, path, nRanks, nNodes);
  return ncclSuccess;
}

static ncclResult_t plugin_destroy(void* ctx) {
  context_t* c = ctx;
  if (c) {
    free(c->rules);
    free(c->logged);
    free(c);
  }
  return ncclSuccess;
}

/* A call no rule matches: NCCL keeps its own choice. */
static ncclResult_t unmatched(ncclFunc_t coll) {
  if (coll >= 0 && coll < NUM_FUNCS) count(&g_unmatched[coll]);
  return ncclSuccess;
}

static const rule_t* first_match(const context_t* c, ncclFunc_t coll, size_t nBytes, int* index) {
  if (c == NULL) return NULL;
  for (int i = 0; i < c->n; i++) {
    const rule_t* r = &c->rules[i];
    if (r->coll == coll && r->minBytes <= nBytes && nBytes <= r->maxBytes) {
      *index = i;
      return r;
    }
  }
  return NULL;
}

/* An entry NCCL may pick: NCCL marks the others with a negative time (NCCL_ALGO_PROTO_IGNORE, -1.0). */
static int available(float cost) { return cost == cost && cost >= 0.0f; }

/* The (algo, proto) a rule asks for, among the entries available in this table, or -1. A rule
 * that names only one of the two gets the cheapest available partner, as NCCL would pick it. */
static int pick_entry(const rule_t* r, const float* table, int numAlgo, int numProto) {
  int best = -1;
  for (int a = 0; a < numAlgo; a++) {
    if (r->algo != UNSET && a != r->algo) continue;
    for (int p = 0; p < numProto; p++) {
      if (r->proto != UNSET && p != r->proto) continue;
      int i = a * numProto + p;
      if (available(table[i]) && (best < 0 || table[i] < table[best])) best = i;
    }
  }
  return best;
}

static const char* algo_name(int a) { return a >= 0 && a < NUM_ALGOS ? ALGO_NAMES[a] : "*"; }
static const char* proto_name(int p) { return p >= 0 && p < NUM_PROTOS ? PROTO_NAMES[p] : "*"; }

static void log_once(context_t* c, int i, int what, const rule_t* r, const char* how) {
  if (c->logged[i] & what) return;
  c->logged[i] |= (unsigned char)what;
  char channels[16] = "*"; /* UNSET: NCCL's choice, written as the rules file writes it */
  if (r->channels != UNSET) snprintf(channels, sizeof channels, "%d", r->channels);
  say(c, NCCL_LOG_INFO, __LINE__, "lagom-tune tuner: rule at line %d (%s %llu..%llu B, %s/%s, %s channels) %s",
      r->line, FUNC_NAMES[r->coll], r->minBytes, r->maxBytes, algo_name(r->algo), proto_name(r->proto),
      channels, how);
}

/* v3 and newer: steer NCCL through its cost table. */
static ncclResult_t coll_info_table(void* ctx, ncclFunc_t coll, size_t nBytes, int numPipeOps, float** costTable,
                                    int numAlgo, int numProto, int regBuff, int* nChannels) {
  (void)numPipeOps;
  (void)regBuff;
  context_t* c = ctx;
  /* The table is float[numAlgo][numProto] handed over as float**. Guard the shape: a table this
   * plugin does not understand is neither read nor written out of bounds. */
  float* table = (costTable && numAlgo > 0 && numAlgo <= 64 && numProto > 0 && numProto <= 16) ? (float*)costTable : NULL;
  if (table) count_nccl_choice(c, coll, nBytes, table, numAlgo, numProto);
  int i;
  const rule_t* r = first_match(c, coll, nBytes, &i);
  if (r == NULL) return unmatched(coll);
  int skipped = 0;
  if (r->algo != UNSET || r->proto != UNSET) {
    int entry = table ? pick_entry(r, table, numAlgo, numProto) : -1;
    if (entry >= 0) table[entry] = 0.0f; /* the cheapest: NCCL picks the minimum available time */
    else skipped = 1;
  }
  if (r->channels != UNSET && nChannels) *nChannels = r->channels;
  count(skipped ? &g_skipped[r->ordinal] : &g_applied[r->ordinal]);
  if (skipped)
    log_once(c, i, LOGGED_SKIPPED, r, r->channels != UNSET ? "skipped algorithm/protocol: not available for this call (channels still set)"
                                                             : "skipped algorithm/protocol: not available for this call");
  else log_once(c, i, LOGGED_APPLIED, r, "applied");
  return ncclSuccess;
}

/* v1 and v2: no cost table; NCCL takes algorithm and protocol as given (both or neither). */
static ncclResult_t coll_info_direct(context_t* c, ncclFunc_t coll, size_t nBytes, int collNetSupport, int nvlsSupport,
                                     int* algorithm, int* protocol, int* nChannels) {
  int i;
  const rule_t* r = first_match(c, coll, nBytes, &i);
  if (r == NULL) return unmatched(coll);
  int skipped = 0;
  if (r->algo != UNSET || r->proto != UNSET) {
    /* Without a cost table NCCL 2.19-2.21 run what the tuner returns unchecked, so only what
     * these versions always have is forced: the Simple protocol (NCCL turns LL128 off where it
     * is unsafe, and LL where it is slow) on ring, or tree for all-reduce; CollNet and NVLS only
     * when NCCL says they are supported; nothing when the user's NCCL_ALGO/NCCL_PROTO narrowed
     * NCCL's choices (the plugin cannot see what they exclude). */
    int a = r->algo, p = r->proto;
    int ok = a != UNSET && p == PROTO_SIMPLE && !c->user_narrowed &&
             (a == ALGO_RING || (a == ALGO_TREE && coll == FUNC_ALLREDUCE) ||
              ((a == ALGO_COLLNET_DIRECT || a == ALGO_COLLNET_CHAIN) && collNetSupport) ||
              ((a == ALGO_NVLS || a == ALGO_NVLS_TREE) && nvlsSupport));
    if (ok && algorithm && protocol) {
      *algorithm = a;
      *protocol = p;
    } else {
      skipped = 1;
    }
  }
  if (r->channels != UNSET && nChannels) *nChannels = r->channels;
  count(skipped ? &g_skipped[r->ordinal] : &g_applied[r->ordinal]);
  if (skipped)
    log_once(c, i, LOGGED_SKIPPED, r, r->channels != UNSET
                                          ? "skipped algorithm/protocol: not forced through this NCCL's tuner API (channels still set)"
                                          : "skipped algorithm/protocol: not forced through this NCCL's tuner API");
  else log_once(c, i, LOGGED_APPLIED, r, "applied");
  return ncclSuccess;
}

/* ---- one entry point per tuner API version ----------------------------------------------------- */

/* v1 has no context argument: one per process, which every communicator's calls share. Once a
 * second communicator of another size has been made, the calls cannot be told apart: only the
 * rules for any communicator stay (each init replaced the last, and the last communicator's
 * rules were applied to all of them). */
static context_t* v1_context;
static size_t v1_ranks, v1_nodes;
static int v1_mixed, v1_live; /* v1_live: communicators inited and not yet destroyed */

static ncclResult_t init_v1(size_t nRanks, size_t nNodes, ncclDebugLogger_t log) {
  if (v1_live > 0 && (nRanks != v1_ranks || nNodes != v1_nodes)) v1_mixed = 1;
  v1_live++;
  v1_ranks = nRanks;
  v1_nodes = nNodes;
  plugin_destroy(v1_context);
  v1_context = NULL;
  void* ctx = NULL;
  ncclResult_t res = plugin_init(nRanks, nNodes, log, &ctx);
  v1_context = ctx;
  if (v1_context && v1_mixed) {
    context_t* c = v1_context;
    int kept = 0;
    for (int i = 0; i < c->n; i++)
      if (c->rules[i].nRanks == ANY && c->rules[i].nNodes == ANY) c->rules[kept++] = c->rules[i];
    if (kept < c->n)
      say(c, NCCL_LOG_WARN, __LINE__, "lagom-tune tuner: NCCL's v1 tuner API cannot tell this process's communicators "
          "apart; %d rule(s) for particular communicators are not applied, %d for any communicator are", c->n - kept, kept);
    c->n = kept;
  }
  return res;
}
static ncclResult_t coll_info_v1(ncclFunc_t coll, size_t nBytes, int collNetSupport, int nvlsSupport, int numPipeOps,
                                 int* algorithm, int* protocol, int* nChannels) {
  (void)numPipeOps;
  return coll_info_direct(v1_context, coll, nBytes, collNetSupport, nvlsSupport, algorithm, protocol, nChannels);
}
static ncclResult_t destroy_v1(void) {
  /* NCCL calls it as each communicator is freed: the others keep the context (and its mixed state) */
  if (v1_live > 0 && --v1_live > 0) return ncclSuccess;
  plugin_destroy(v1_context);
  v1_context = NULL;
  v1_mixed = 0; /* the last one gone: the next init starts afresh */
  return ncclSuccess;
}

static ncclResult_t coll_info_v2(void* ctx, ncclFunc_t coll, size_t nBytes, int collNetSupport, int nvlsSupport,
                                 int numPipeOps, int* algorithm, int* protocol, int* nChannels) {
  (void)numPipeOps;
  return coll_info_direct(ctx, coll, nBytes, collNetSupport, nvlsSupport, algorithm, protocol, nChannels);
}

static ncclResult_t coll_info_v3(void* ctx, ncclFunc_t coll, size_t nBytes, int numPipeOps, float** costTable,
                                 int numAlgo, int numProto, int* nChannels) {
  return coll_info_table(ctx, coll, nBytes, numPipeOps, costTable, numAlgo, numProto, 0, nChannels);
}

static ncclResult_t init_v5(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                            void* nvlDomainInfo, void* constants) {
  (void)commId;
  (void)nvlDomainInfo;
  (void)constants; /* NCCL's tuning constants are left as they are */
  return plugin_init(nRanks, nNodes, log, ctx);
}

EXPORT const tuner_v1_t ncclTunerPlugin_v1 = {PLUGIN_NAME, init_v1, coll_info_v1, destroy_v1};
EXPORT const tuner_v2_t ncclTunerPlugin_v2 = {PLUGIN_NAME, plugin_init, coll_info_v2, plugin_destroy};
EXPORT const tuner_v3_t ncclTunerPlugin_v3 = {PLUGIN_NAME, plugin_init, coll_info_v3, plugin_destroy};
EXPORT const tuner_v4_t ncclTunerPlugin_v4 = {PLUGIN_NAME, plugin_init, coll_info_table, plugin_destroy};
EXPORT const tuner_v5_t ncclTunerPlugin_v5 = {PLUGIN_NAME, init_v5, coll_info_table, plugin_destroy};
EXPORT const tuner_v6_t ncclTunerPlugin_v6 = {PLUGIN_NAME, init_v5, coll_info_table, plugin_destroy, NULL};
EXPORT const tuner_v6_t ncclTunerPlugin_v7 = {PLUGIN_NAME, init_v5, coll_info_table, plugin_destroy, NULL};
