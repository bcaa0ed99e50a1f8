/* Reference for `tandem bench allreduce`: MPI_Allreduce (in place, SUM) timed the same way and
 * printed in the same columns, to compare the shm backend with OpenMPI's shared-memory ring:
 *   mpicc -O2 -o /tmp/mpi_allreduce_ref bench/mpi_allreduce_ref.c
 *   mpirun --allow-run-as-root -np 2 --mca pml ob1 --mca btl self,vader \
 *     --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4 \
 *     /tmp/mpi_allreduce_ref [min_bytes] [max_bytes] [iters]
 * (algorithm 4 = ring). f32 only (MPI has no bf16 type). Built by hand; not part of the CMake build.
 * Columns as in tandem's: time_us (slowest rank's mean), p50_us (slowest rank's median
 * iteration), busbw_p50, cpu_us (most process CPU time per iteration on one rank). */
#include <mpi.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double cpu_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}
static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t min_bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 4096;
  size_t max_bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)128 << 20;
  int base_iters = argc > 3 ? atoi(argv[3]) : 20;
  float* buf = aligned_alloc(64, max_bytes);
  memset(buf, 0, max_bytes);
  if (rank == 0) {
    printf("# MPI_Allreduce reference: %d ranks, f32, SUM in place\n", n);
    printf("# %12s %12s %6s %12s %12s %12s %10s %10s %10s\n", "bytes", "count", "dtype", "time_us", "algbw(GB/s)",
           "busbw(GB/s)", "p50_us", "busbw_p50", "cpu_us");
  }
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    int count = (int)(bytes / 4);
    size_t scaled = ((size_t)1 << 20) / bytes * (size_t)base_iters / 4;
    int iters = (int)(scaled > (size_t)base_iters ? (scaled < 20000 ? scaled : 20000) : (size_t)base_iters);
    for (int i = 0; i < 5; ++i) MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double* each = malloc(sizeof(double) * (size_t)iters);
    double c0 = cpu_us();
    double t0 = MPI_Wtime(), prev = t0;
    for (int i = 0; i < iters; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double now = MPI_Wtime();
      each[i] = (now - prev) * 1e6;
      prev = now;
    }
    double mine[3], slowest[3];
    mine[0] = (prev - t0) * 1e6 / iters;
    mine[2] = (cpu_us() - c0) / iters;
    qsort(each, (size_t)iters, sizeof(double), cmp_double);
    mine[1] = each[iters / 2];
    free(each);
    MPI_Allreduce(mine, slowest, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) {
      double algbw = (double)count * 4 / (slowest[0] * 1e3);
      printf("  %12zu %12d %6s %12.2f %12.3f %12.3f %10.2f %10.3f %10.2f\n", (size_t)count * 4, count, "f32", slowest[0],
             algbw, algbw * 2.0 * (n - 1) / n, slowest[1], (double)count * 4 / (slowest[1] * 1e3) * 2.0 * (n - 1) / n,
             slowest[2]);
      fflush(stdout);
    }
  }
  free(buf);
  MPI_Finalize();
  return 0;
}
