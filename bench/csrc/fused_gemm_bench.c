/* Microbenchmark of the fused decode step's linears (kernels/csrc/decode_cpu.c), one thread:
 * best of 20 calls per shape (bench-15m and SmolLM2-135M projections, SmolLM2's lm_head), M = 1, 4, 16.
 *
 *   cc -O3 -march=native -fopenmp -I. -o /tmp/fused_gemm_bench bench/csrc/fused_gemm_bench.c \
 *      kernels/csrc/*.c -lm && /tmp/fused_gemm_bench
 *
 * Compare versions by building it against another revision's decode_cpu.c (docs/kernels.md). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kernels/csrc/decode_cpu.h"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int shapes[][2]={{864,288},{288,288},{1536,288},{288,768},{960,576},{576,576},{3072,576},{576,1536},{49152,576}};
  int Ms[]={1,4,16};
  Model m={0};
  for(int s=0;s<9;s++) for(int mi=0;mi<3;mi++){
    int N=shapes[s][0],K=shapes[s][1],M=Ms[mi];
    float*W=aligned_alloc(64,sizeof(float)*N*K),*x=aligned_alloc(64,4*M*K+64),*y=aligned_alloc(64,4*M*N+64);
    for(long i=0;i<(long)N*K;i++)W[i]=(i%7)*0.01f; for(int i=0;i<M*K;i++)x[i]=1;
    double best=1e9; int reps = 20;
    for(int r=0;r<reps;r++){double t=now(); linear(&m,x,M,K,W,NULL,N,y,0,1); t=now()-t; if(t<best)best=t;}
    printf("N=%5d K=%4d M=%2d  %.3f ms  %.1f GB/s  %.1f GFLOP/s\n",N,K,M,best*1e3,4.0*N*K/best/1e9,2.0*M*N*K/best/1e9);
    free(W);free(x);free(y);
  }
}
