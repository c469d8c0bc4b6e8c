// Package ringbuf keeps the most recent samples of a metric in a fixed-size ring buffer
// and answers simple window statistics over them.
package ringbuf

import (
	"errors"
	"math"
	"sort"
	"sync"
)

// ErrEmpty is returned by statistics over a buffer that holds no samples.
var ErrEmpty = errors.New("ringbuf: no samples")

// Buffer holds up to a fixed number of float64 samples, overwriting the oldest.
type Buffer struct {
	mu      sync.Mutex
	samples []float64
	next    int
	count   int
}

// New returns a buffer that keeps the last capacity samples.
func New(capacity int) *Buffer {
	if capacity <= 0 {
		panic("ringbuf: capacity must be positive")
	}
	return &Buffer{samples: make([]float64, capacity)}
}

// Add appends a sample, dropping the oldest one when the buffer is full.
func (b *Buffer) Add(value float64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.samples[b.next] = value
	b.next = (b.next + 1) % len(b.samples)
	if b.count < len(b.samples) {
		b.count++
	}
}

// Len is the number of samples held.
func (b *Buffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.count
}

// Values returns the samples from oldest to newest.
func (b *Buffer) Values() []float64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]float64, 0, b.count)
	start := b.next - b.count
	if start < 0 {
		start += len(b.samples)
	}
	for i := 0; i < b.count; i++ {
		out = append(out, b.samples[(start+i)%len(b.samples)])
	}
	return out
}

// Mean is the average of the samples held.
func (b *Buffer) Mean() (float64, error) {
	values := b.Values()
	if len(values) == 0 {
		return 0, ErrEmpty
	}
	sum := 0.0
	for _, v := range values {
		sum += v
	}
	return sum / float64(len(values)), nil
}

// Percentile returns the p-th percentile (0 <= p <= 100) of the samples held, by the
// nearest-rank method.
func (b *Buffer) Percentile(p float64) (float64, error) {
	values := b.Values()
	if len(values) == 0 {
		return 0, ErrEmpty
	}
	if p < 0 || p > 100 {
		return 0, errors.New("ringbuf: percentile out of range")
	}
	sort.Float64s(values)
	rank := int(math.Ceil(p / 100 * float64(len(values))))
	return values[rank], nil
}

// Max is the largest sample held.
func (b *Buffer) Max() (float64, error) {
	values := b.Values()
	if len(values) == 0 {
		return 0, ErrEmpty
	}
	best := math.Inf(-1)
	for _, v := range values {
		best = math.Max(best, v)
	}
	return best, nil
}

// Reset drops every sample.
func (b *Buffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.next, b.count = 0, 0
}
