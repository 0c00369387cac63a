/* Annotations for the sanitizers that CI runs the row copy under (tests/native): nothing in an
 * ordinary build.
 *
 * PLE_RACY_READS_BEGIN / _END bracket a read that is meant to race with a writer and whose result is
 * thrown away when it did: a sequence lock's copy (rowcache.c's ple_cache_get copies a slot's row
 * while a writer may be replacing it; the slot's version, read with acquire/relaxed atomics before
 * and after, tells it whether the copy is whole, and a torn copy is never used). ThreadSanitizer
 * cannot see that the version check makes the race harmless, so the reads in between are not
 * recorded; the version's atomics still are. */
#ifndef PLE_SANITIZE_H
#define PLE_SANITIZE_H

#if defined(__SANITIZE_THREAD__)
#define PLE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PLE_TSAN 1
#endif
#endif

#if defined(PLE_TSAN) && !defined(PLE_NO_RACE_ANNOTATIONS) /* the latter: tests/native sees the race */
void AnnotateIgnoreReadsBegin(const char *file, int line);
void AnnotateIgnoreReadsEnd(const char *file, int line);
#define PLE_RACY_READS_BEGIN() AnnotateIgnoreReadsBegin(__FILE__, __LINE__)
#define PLE_RACY_READS_END() AnnotateIgnoreReadsEnd(__FILE__, __LINE__)
#else
#define PLE_RACY_READS_BEGIN() ((void)0)
#define PLE_RACY_READS_END() ((void)0)
#endif

#endif
