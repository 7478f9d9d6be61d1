// Machine-state probe: core-to-core round trip (ns) between CPU 0 and 1, and FMA throughput per CPU
// alone and both at once (GFLOP/s). Build: gcc -O2 -mavx2 -mfma -pthread cpuprobe.c -o cpuprobe
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static _Alignas(128) atomic_int flag;
#define ROUNDS 200000
static void* pong(void*a){pin(1);for(int i=0;i<ROUNDS;i++){while(atomic_load_explicit(&flag,memory_order_acquire)!=1);atomic_store_explicit(&flag,0,memory_order_release);}return 0;}
static double pingpong(void){pthread_t t;atomic_store(&flag,0);pthread_create(&t,0,pong,0);pin(0);
 double t0=now();for(int i=0;i<ROUNDS;i++){atomic_store_explicit(&flag,1,memory_order_release);while(atomic_load_explicit(&flag,memory_order_acquire)!=0);}
 double dt=now()-t0;pthread_join(t,0);return dt/ROUNDS*1e9;}
#define N 20000000L
static volatile float sink;
static double fma_run(void){__m256 a[8],x=_mm256_set1_ps(0.999f),y=_mm256_set1_ps(1e-3f);for(int j=0;j<8;j++)a[j]=_mm256_set1_ps(j);
 double t0=now();for(long i=0;i<N;i++){for(int j=0;j<8;j++)a[j]=_mm256_fmadd_ps(a[j],x,y);}double dt=now()-t0;
 float s=0;for(int j=0;j<8;j++){float b[8];_mm256_storeu_ps(b,a[j]);s+=b[0];}sink=s;return N*8*8*2/dt/1e9;}
static double res[2];
static void* fma_on(void*a){int c=(int)(long)a;pin(c);res[c]=fma_run();return 0;}
int main(void){double pp=pingpong();pin(0);double f0=fma_run();pin(1);double f1=fma_run();
 pthread_t t[2];for(long c=0;c<2;c++)pthread_create(&t[c],0,fma_on,(void*)c);for(int c=0;c<2;c++)pthread_join(t[c],0);
 printf("%.0f %.1f %.1f %.1f %.1f\n",pp,f0,f1,res[0],res[1]);return 0;}
